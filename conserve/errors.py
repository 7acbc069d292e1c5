"""Errors a user can act on (each message names the fix), and ``warn``: conserve's warnings, at the user's line."""


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


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn`` at the user's line: the first frame of the stack outside conserve and torch (a
    warning raised inside ``optimizer.step()`` names the training loop's ``opt.step()``, not a hook or
    ``torch/_dynamo/eval_frame.py``); at conserve's caller when the whole stack is conserve's or torch's
    (``atexit``, garbage collection)."""
    import os
    import sys
    import warnings

    inside = [os.path.dirname(os.path.abspath(__file__)) + os.sep]
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__file__", None):
        inside.append(os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
    inside = tuple(inside)
    f, level = sys._getframe(1), 2  # (stacklevel 2: this function's caller)
    while f is not None and (f.f_code.co_filename.startswith(inside) or f.f_code.co_filename.startswith("<frozen")):
        f, level = f.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if f is not None else 2)
