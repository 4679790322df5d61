"""Pipeline schedules as data: the IR, the builders, lowering, the checks, the simulator,
drawing, the rules and the registry. Pure Python: config validation and the planner read it
without torch; plait/parallel/pipeline/ executes what it builds."""
