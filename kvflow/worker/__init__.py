"""The worker's side of a step: the ModelRunner (model_runner.py) turns a SchedulerOutput into
batch tensors, runs one forward and samples."""
