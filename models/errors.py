"""The error the model code raises for a checkpoint it cannot load, below every module that
raises it (weights, layers, the models)."""


class WeightError(ValueError):
    """A checkpoint is damaged or does not match the model: names the file or tensor and the problem."""
