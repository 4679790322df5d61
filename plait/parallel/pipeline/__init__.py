"""Pipeline parallelism's runtime: partition the model, execute the lowered lists that
plait/schedule/ builds, measure the steps."""
