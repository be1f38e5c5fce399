"""The relay secret: where it comes from, how a new one is made and kept.

Any message computed from the secret that reaches a peer before that peer proved anything (the
first proof of a handshake) can be tried offline against guesses of the secret, so the secret
must be random, never a word: a new one is 32 random bytes (written as 43 URL-safe characters),
and one given by hand shorter than 32 bytes is refused. No message ever carries the secret.

Examples:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "relay-secret")
    >>> write_secret_file(path)
    >>> oct(os.stat(path).st_mode & 0o777), len(read_secret_file(path))
    ('0o600', 43)
"""

from __future__ import annotations

import os
import secrets
import stat

from shmsync.errors import InvalidArgumentError, SecretFileError

SECRET_ENV = "SHMSYNC_RELAY_SECRET"
SECRET_FILE_ENV = "SHMSYNC_RELAY_SECRET_FILE"
SECRET_BYTES = 32  # random bytes in a new secret
MIN_SECRET_BYTES = 32  # a secret given by hand
MAX_SECRET_BYTES = 4096


def new_secret() -> str:
    """A new random secret: 32 random bytes, as 43 URL-safe characters."""
    return secrets.token_urlsafe(SECRET_BYTES)


def resolve_secret(
    secret: str | bytes | None = None, *, generate: bool = False, given_as: str = "pass secret=..."
) -> tuple[bytes, bool]:
    """The relay secret: ``secret`` itself, else ``$SHMSYNC_RELAY_SECRET``, else the file named by
    ``$SHMSYNC_RELAY_SECRET_FILE`` (which only this user may read), else, with ``generate``, a new
    random one. Returns ``(secret, generated)``. ``given_as``: how the caller's user gives
    ``secret`` (a command says ``--secret-file FILE``), for the message when there is none.

    Raises:
        ValueError: no secret anywhere (and ``generate`` is False), or one shorter than 32 bytes
            (the message says where it came from and how long it is, never what it is).
        PermissionError: the secret file may be read or written by others.
    """
    generated, source = False, "the secret given"
    if secret is None and os.environ.get(SECRET_ENV):
        secret, source = os.environ[SECRET_ENV], f"${SECRET_ENV}"
    if secret is None and os.environ.get(SECRET_FILE_ENV):
        secret, source = read_secret_file(os.environ[SECRET_FILE_ENV]), f"the file in ${SECRET_FILE_ENV}"
    if secret is None:
        if not generate:
            raise InvalidArgumentError(
                f"no relay secret: {given_as}, set ${SECRET_ENV}, or name a file only you can read in "
                f"${SECRET_FILE_ENV} (`shmsync new-secret FILE` makes one)"
            )
        secret, generated = new_secret(), True
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not MIN_SECRET_BYTES <= len(raw) <= MAX_SECRET_BYTES:
        raise InvalidArgumentError(
            f"{source} is {len(raw)} bytes; a relay secret must be {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} random "
            f"bytes (a shorter or chosen one can be guessed offline): make one with `shmsync new-secret FILE`"
        )
    return raw, generated


def read_secret_file(path: str) -> bytes:
    """The secret in ``path``, stripped of surrounding whitespace; the file must be a regular file of
    this user that nobody else may read or write (mode 0600 or stricter)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or mode & 0o077:
            raise SecretFileError(
                f"relay secret file {path}: want a regular file of yours that only you can read (chmod 600), "
                f"got mode {mode:#o}, uid {st.st_uid}"
            )
        return os.read(fd, MAX_SECRET_BYTES + 1).strip()
    finally:
        os.close(fd)


def write_secret_file(path: str) -> None:
    """Write a new random secret to ``path``, a new file only this user can read (mode 0600 from its
    creation, whatever the umask); refuses to replace an existing file or to follow a link.

    Raises:
        FileExistsError: ``path`` exists (nothing is overwritten).
    """
    old = os.umask(0o077)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    finally:
        os.umask(old)
    try:
        os.write(fd, (new_secret() + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
