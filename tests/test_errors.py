"""shmsync's errors (shmsync/errors.py): one family a caller can catch whole, each also the
built-in error of its kind, each importable from ``shmsync`` or named in the API reference; and
its one warning category."""

import builtins
import inspect

import shmsync
from shmsync import errors
from tests.commands import CHECKOUT

ERRORS = [
    e
    for _, e in inspect.getmembers(errors, inspect.isclass)
    if issubclass(e, BaseException) and not issubclass(e, Warning)
]


def test_every_error_is_a_shmsync_error_and_a_runtime_or_builtin_kind():
    assert errors.ShmSyncError in ERRORS and len(ERRORS) > 20
    for error in ERRORS:
        assert issubclass(error, errors.ShmSyncError), error
        kinds = [b for b in error.__mro__[1:] if getattr(builtins, b.__name__, None) is b]
        assert kinds, f"{error.__name__} is no built-in error kind"


def test_every_error_says_when_it_is_raised():
    for error in ERRORS:
        assert error.__doc__ and len(error.__doc__.split()) >= 5, error.__name__


def test_the_errors_a_user_catches_are_importable_from_shmsync():
    for name in ("ClosedError", "NotAttachedError", "StaleReaderError", "WeightMismatchError", "WriterGoneError"):
        assert getattr(shmsync, name) is getattr(errors, name)


def test_the_api_reference_documents_the_errors_module():
    assert ".. automodule:: shmsync.errors" in (CHECKOUT / "docs" / "api.md").read_text()


def test_the_one_warning_category_is_a_user_warning_said_when_it_is_given():
    warnings = [e for _, e in inspect.getmembers(errors, inspect.isclass) if issubclass(e, Warning)]
    assert warnings == [errors.FreshnessWarning]
    assert issubclass(errors.FreshnessWarning, UserWarning) and len(errors.FreshnessWarning.__doc__.split()) >= 5
