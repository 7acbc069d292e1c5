"""Errors a user can act on. Each message names the fix."""


class UsageError(Exception):
    """Bad input from the user (a file, an option, a model): printed as one line, exit code 2."""


class UnsupportedModelError(UsageError):
    """A model or block that conserve cannot handle; the message says why and what to do."""


class NonFiniteError(UsageError):
    """NaN or Inf in the loss, gradients or parameters; the message names the step."""


class DivergenceError(UsageError):
    """Training diverged (exploding loss, or a law's ``eps`` beyond a bound); the message names the step and the fix."""


class StaleParameterError(UsageError, RuntimeError):
    """A tracked parameter is no longer the model's (replaced, re-shaped, parametrized): rebuild the tracker."""
