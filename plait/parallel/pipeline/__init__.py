"""Pipeline parallelism: schedules as data (IR, builders, lowering, checks, simulation)."""
