"""The gradient list a model's training all-reduces, for `allreduce --gradients`
and `project`."""


def shapes(model_name):
    """The trainable-variable shapes of `models.get(model_name)`.

    Forward order, at the model's default (published) input size and 1000
    classes: what a step's gradients are.
    """
    from tfscale import models

    model = models.get(model_name)
    return [list(v.shape) for v in model.trainable_variables]
