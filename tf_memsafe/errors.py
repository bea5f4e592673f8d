"""Exceptions raised by tf_memsafe.  All derive from :class:`TfMemsafeError`."""

from __future__ import annotations

__all__ = ["TfMemsafeError", "RewriteError", "UnsupportedTensorFlowError"]


class TfMemsafeError(Exception):
    """Base class of tf_memsafe's errors."""


class RewriteError(TfMemsafeError):
    """A pass or the verifier failed on a traced function (raised only with ``strict=True``).

    Attributes:
      pass_name: the failing pass (or ``"verifier"`` after it), ``None`` outside a pass.
      previous_passes: the passes that ran before it, in order.
      function_name: the traced function.
    """

    def __init__(self, message: str, *, pass_name: str | None = None,
                 previous_passes: tuple[str, ...] = (), function_name: str | None = None):
        super().__init__(message)
        self.pass_name = pass_name
        self.previous_passes = tuple(previous_passes)
        self.function_name = function_name


class UnsupportedTensorFlowError(TfMemsafeError):
    """The running TensorFlow's internals are not those tf_memsafe was built against."""
