"""Making a memory plan for a PyTorch model: `planner` (`plan_memory`, `measure_profile`: capture the step, time
its operations, call `ucudnn.memory`'s planner) and `replay_cost` (what recomputing a map costs the host, measured
by running the executor). Imports the rooms below it: converting, capturing, running.
"""
