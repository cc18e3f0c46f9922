"""Checking a plan against real steps: `tracker` (`StepTracker`: a step's memory counted exactly from live
storages), `check` (`check_plan`: a plan's predicted peak, time and bytes moved beside a real step's) and
`graph_model` (a training graph as a PyTorch model, so that a zoo network's plan can be checked). The top room.
"""
