"""Authentication of the control channel: configuration and loading (see docs/SECURITY.md).

Two mechanisms, each optional, usable together:

* **CURVE** (:class:`CurveConfig`): ZMQ's CurveZMQ encrypts every connection
  and authenticates both ends. The ROUTER is a CURVE server with this rank's
  key pair and a ZAP handler that admits only ``allowed_clients``; every
  DEALER is a CURVE client with the same key pair that expects the server
  key ``server_key`` (default: this rank's own public key, for a deployment
  that shares one key pair). An unknown client never completes the ZMQ
  handshake, so none of its bytes reach the decoder. The id of a peer the
  channel connected to is bound to the key that peer proved; the allow-list
  binds no other id to a key (docs/SECURITY.md, "One key pair per rank").
* **Shared secret** (``ChannelAuth.shared_secret``): every frame carries an
  HMAC-SHA256 over the path it takes (DEALER to ROUTER or back), the sender
  id, the receiver id, a time-based stamp that increases per sender, and the
  payload. A frame without a valid MAC, or with a stamp not newer than the
  last one from that sender on that path, is dropped before decoding; the
  only answer, to a bad MAC, is a fixed notice (``_auth.REFUSED_NOTICE``).
  It authenticates frames, not connections, and does not encrypt.

:func:`load_channel_auth` builds a :class:`ChannelAuth` from the environment
(read in :mod:`ncclkv._env`); ``Channel(..., auth=None)`` does that itself.
"""

from __future__ import annotations

import glob
import grp
import hashlib
import hmac
import logging
import math
import os
import pwd
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth

from ._env import EnvSettings, env_settings
from .errors import InsecureFileError, ProtocolError

__all__ = [
    "MIN_SECRET_BYTES",
    "AuthenticationError",
    "ChannelAuth",
    "CurveConfig",
    "curve_key",
    "load_channel_auth",
    "load_curve_files",
    "load_shared_secret",
]

log = logging.getLogger("ncclkv.auth")

MIN_SECRET_BYTES = 32  # HMAC-SHA256 key: no shorter than the digest
_Z85_KEY = re.compile(rb"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")


class AuthenticationError(ProtocolError):
    """A control frame without a valid MAC, or a replayed one; it is dropped unanswered."""


def curve_key(value: bytes | str, what: str = "CURVE key") -> bytes:
    """``value`` as Z85 bytes; ``ValueError`` naming ``what`` unless it is a 40-character Z85 key."""
    key = value.encode("ascii", "replace") if isinstance(value, str) else bytes(value)
    if not _Z85_KEY.fullmatch(key):
        raise ValueError(f"{what} must be a 40-character Z85 CURVE key, got {len(key)} bytes")
    return key


@dataclass(frozen=True, slots=True)
class CurveConfig:
    """This rank's CURVE key pair, the server key its DEALERs expect, and the clients its ROUTER admits.

    Keys are Z85 text (40 characters), as ``zmq.curve_keypair()`` and
    ``zmq.auth`` certificates hold them; ``str`` is accepted too.
    """

    public_key: bytes
    secret_key: bytes = field(repr=False)
    server_key: bytes
    allowed_clients: frozenset[bytes]

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "public_key", curve_key(self.public_key, "CurveConfig.public_key"))
        set_(self, "secret_key", curve_key(self.secret_key, "CurveConfig.secret_key"))
        set_(self, "server_key", curve_key(self.server_key, "CurveConfig.server_key"))
        if zmq.curve_public(self.secret_key) != self.public_key:
            raise ValueError("CurveConfig.public_key does not belong to CurveConfig.secret_key")
        allowed = frozenset(curve_key(k, "an allowed client key") for k in self.allowed_clients)
        if not allowed:
            raise ValueError("CurveConfig.allowed_clients is empty: no peer could connect")
        set_(self, "allowed_clients", allowed)

    @classmethod
    def from_secret_key(
        cls,
        secret_key: bytes | str,
        *,
        server_key: bytes | str | None = None,
        allowed_clients: frozenset[bytes] | set[bytes] | None = None,
    ) -> CurveConfig:
        """From a secret key alone: the public key is derived; server key and allowed
        clients default to that public key (one key pair shared by the deployment)."""
        secret = curve_key(secret_key, "CURVE secret key")
        public = zmq.curve_public(secret)
        allowed = frozenset(allowed_clients) if allowed_clients is not None else frozenset({public})
        return cls(public, secret, curve_key(server_key, "CURVE server key") if server_key else public, allowed)


@dataclass(frozen=True, slots=True)
class ChannelAuth:
    """How a :class:`~ncclkv.channel.Channel` authenticates its peers; ``ChannelAuth()`` means not at all.

    ``max_clock_skew_s`` bounds, in shared-secret mode, how far the stamp of
    the first frame from a sender may be from this host's clock: a frame
    recorded earlier cannot be replayed to a restarted receiver.
    """

    curve: CurveConfig | None = None
    shared_secret: bytes | None = field(default=None, repr=False)
    max_clock_skew_s: float = 300.0

    def __post_init__(self) -> None:
        if self.curve is not None and not isinstance(self.curve, CurveConfig):
            raise TypeError(f"ChannelAuth.curve must be a CurveConfig, got {type(self.curve).__name__}")
        if self.shared_secret is not None:
            if not isinstance(self.shared_secret, bytes | bytearray):
                raise TypeError(f"ChannelAuth.shared_secret must be bytes, got {type(self.shared_secret).__name__}")
            if len(self.shared_secret) < MIN_SECRET_BYTES:
                raise ValueError(
                    f"ChannelAuth.shared_secret has {len(self.shared_secret)} bytes; use at least {MIN_SECRET_BYTES}"
                )
            object.__setattr__(self, "shared_secret", bytes(self.shared_secret))
        if not (math.isfinite(self.max_clock_skew_s) and self.max_clock_skew_s > 0):  # inf: no replay bound
            raise ValueError(f"ChannelAuth.max_clock_skew_s must be a finite number > 0, got {self.max_clock_skew_s}")

    @property
    def enabled(self) -> bool:
        return self.curve is not None or self.shared_secret is not None

    def link_id(self, a: str, b: str, session: str) -> str:
        """The data-plane link id of peers ``a`` and ``b`` for handshake ``session`` (either order).

        Both ends rendezvous in the TCPStore under this id, and the first to join
        as a link rank holds that rank. With a shared secret the id is an HMAC, so
        a process that saw the session in clear (it travels in the handshake)
        cannot compute it and join before both ends. With CURVE alone the session
        is encrypted on the wire; without auth the id is public. Any client of
        the store can still list the id once one end joined, and join the other
        rank first (docs/SECURITY.md, "The data plane").
        """
        low, high = sorted((a, b))
        text = f"{low}|{high}|{session}".encode()
        if self.shared_secret is not None:
            digest = hmac.new(self.shared_secret, b"ncclkv link id|" + text, hashlib.sha256).hexdigest()
        else:
            digest = hashlib.sha256(text).hexdigest()
        return f"kv-{digest[:32]}"

    def describe(self) -> str:
        """A log-safe summary (no key material)."""
        parts = []
        if self.curve is not None:
            parts.append(f"curve(public={self.curve.public_key.decode()}, {len(self.curve.allowed_clients)} allowed)")
        if self.shared_secret is not None:
            parts.append("hmac-sha256")
        return " + ".join(parts) or "none"


def _read_only_mount(path: Path) -> bool:
    """Whether ``path`` lies on a file system mounted read-only (a Kubernetes secret volume): no one changes it."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _private_group(info: os.stat_result) -> bool:
    """Whether the file's group is its owner's own (a user private group, as with umask 002): no one else in it.

    /etc/group does not list those whose primary group it is (a 'users' group all users share): as OpenSSH
    (Debian's group-writable rule), every user whose primary group it is must be the owner too."""
    try:
        owner = pwd.getpwuid(info.st_uid)
        group = grp.getgrgid(info.st_gid)
    except KeyError:
        return False
    if owner.pw_gid != info.st_gid or not set(group.gr_mem) <= {owner.pw_name}:
        return False
    return all(user.pw_uid == owner.pw_uid for user in pwd.getpwall() if user.pw_gid == info.st_gid)


def _check_file_modes(path: Path, what: str, *, secret: bool) -> None:
    """Refuse ``path`` (a file or directory) that someone else could change, or, ``secret``, read.

    As OpenSSH's StrictModes: the owner must be this process's user or root, and neither others nor the group
    (unless it is the owner's private group) may write it; a read-only mount passes that. A secret may not be
    readable by others, nor by the group unless the owner is root (a mount's group, Kubernetes' fsGroup) or the
    group is the owner's own (as PostgreSQL takes its key files)."""
    info = path.stat()
    mode = stat.S_IMODE(info.st_mode)
    where = f"{what} {str(path)!r} (mode 0o{mode:03o}, owner uid {info.st_uid}, group gid {info.st_gid})"
    if not _read_only_mount(path):
        me = os.geteuid()
        if info.st_uid not in (me, 0):
            raise InsecureFileError(
                f"{where} is owned by another user than this process's (uid {me}) or root: that user could change "
                f"it; give it to this user or root", str(path), mode)
        if mode & stat.S_IWOTH or (mode & stat.S_IWGRP and not _private_group(info)):
            whom = "others" if mode & stat.S_IWOTH else "its group"
            raise InsecureFileError(
                f"{where} is writable by {whom}, who could put their own key or secret in it; chmod go-w it", str(path), mode)
    if secret and (mode & stat.S_IROTH or (mode & stat.S_IRGRP and info.st_uid != 0 and not _private_group(info))):
        whom = "others" if mode & stat.S_IROTH else "its group"
        raise InsecureFileError(
            f"{where} is readable by {whom}; chmod 600 it (Kubernetes: the secret's defaultMode 0400; Docker: the "
            f"secret's mode 0400)", str(path), mode)


def load_shared_secret(path: str | os.PathLike[str]) -> bytes:
    """The HMAC key in ``path``: its bytes, surrounding whitespace stripped, at least :data:`MIN_SECRET_BYTES`.

    :class:`~ncclkv.errors.InsecureFileError` if others could read or change the file (docs/SECURITY.md)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"shared secret file {str(file)!r} does not exist or is not a file")
    _check_file_modes(file, "shared secret file", secret=True)
    try:
        secret = file.read_bytes().strip()
    except OSError as exc:  # not readable by this user (a root-owned 0400 mount in a non-root container)
        raise ValueError(f"cannot read shared secret file {str(file)!r}: {exc}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"shared secret in {str(file)!r} has {len(secret)} bytes; need at least {MIN_SECRET_BYTES}")
    return secret


def _refuse_unless_file(path: Path, what: str) -> None:
    """Refuse a ``path`` there that is no regular file (after its symlinks), before anything opens it: opening a
    FIFO waits for a writer for ever, a directory or a symlink to nothing fails with an OSError."""
    if (path.exists() or path.is_symlink()) and not path.is_file():
        raise ValueError(f"{what} {str(path)!r} is not a file (a directory, a FIFO, a device or a symlink to "
                         f"nothing); point at a certificate file or remove it")


def _certificate(path: str | os.PathLike[str], *, secret: bool, what: str) -> tuple[bytes, bytes | None]:
    file = Path(path)
    _refuse_unless_file(file, what)
    try:
        public, secret_key = zmq.auth.load_certificate(file)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load CURVE certificate {str(file)!r}: {exc}") from None
    if secret and secret_key is None:
        raise ValueError(f"CURVE certificate {str(file)!r} holds no secret-key (use the .key_secret file)")
    _check_file_modes(file, what, secret=secret)
    return public, secret_key


def load_curve_files(
    secret_file: str | os.PathLike[str],
    public_file: str | os.PathLike[str] | None = None,
    allowed_dir: str | os.PathLike[str] | None = None,
) -> CurveConfig:
    """A :class:`CurveConfig` from ``zmq.auth`` certificate files.

    ``secret_file``: this rank's ``.key_secret`` certificate (public and secret
    key). ``public_file``: the certificate of the server key this rank's
    DEALERs expect (default: this rank's own). ``allowed_dir``: a directory
    whose ``*.key`` certificates are the clients admitted (default: only this
    rank's own public key).

    Each file, and the directory, is refused with :class:`~ncclkv.errors.InsecureFileError` if anyone but
    this user or root could change it, and the secret certificate if others could read it (docs/SECURITY.md).
    """
    public, secret = _certificate(secret_file, secret=True, what="CURVE secret certificate")
    assert secret is not None
    server = _certificate(public_file, secret=False, what="CURVE server-key certificate")[0] if public_file else None
    allowed: frozenset[bytes] | None = None
    if allowed_dir:
        directory = Path(allowed_dir)
        if not directory.is_dir():
            raise ValueError(f"CURVE allowed-clients directory {str(directory)!r} does not exist")
        # Whoever can add or change a file here is admitted: the directory and every *.key it holds (the files
        # zmq.auth.load_certificates reads) are this user's or root's and no one else's to write.
        _check_file_modes(directory, "CURVE allowed-clients directory", secret=False)
        # The *.key files, as zmq.auth.load_certificates finds them, but of this directory even if its name is a
        # glob pattern ("keys[1]"), and read here: the files checked are the files read.
        key_files = sorted(glob.glob(os.path.join(glob.escape(str(directory)), "*.key")))
        for key_file in key_files:
            _refuse_unless_file(Path(key_file), "CURVE allowed-client certificate")
            _check_file_modes(Path(key_file), "CURVE allowed-client certificate", secret=False)
        allowed = frozenset(key for key in (zmq.auth.load_certificate(f)[0] for f in key_files) if key)
        if not allowed:
            raise ValueError(f"CURVE allowed-clients directory {str(directory)!r} holds no *.key certificate")
    config = CurveConfig.from_secret_key(secret, server_key=server, allowed_clients=allowed)
    if config.public_key != public:
        raise ValueError(f"public-key in {str(secret_file)!r} does not belong to its secret-key")
    return config


def load_channel_auth(settings: EnvSettings | None = None) -> ChannelAuth:
    """The :class:`ChannelAuth` the environment configures (``ChannelAuth()`` if none).

    CURVE from ``NCCLKV_CURVE_SECRET_FILE`` (+ ``NCCLKV_CURVE_PUBLIC_FILE``,
    ``NCCLKV_CURVE_ALLOWED_DIR``) or from ``NCCLKV_CURVE_SECRET_KEY`` (+
    ``NCCLKV_CURVE_SERVER_KEY``, ``NCCLKV_CURVE_ALLOWED_KEYS``, comma
    separated); the shared secret from ``NCCLKV_SHARED_SECRET_FILE`` or
    ``NCCLKV_SHARED_SECRET``. Setting both the file and the value of one
    mechanism is refused as ambiguous.
    """
    env = env_settings() if settings is None else settings
    curve: CurveConfig | None = None
    if env.curve_secret_file and env.curve_secret_key:
        raise ValueError("set NCCLKV_CURVE_SECRET_FILE or NCCLKV_CURVE_SECRET_KEY, not both")
    if env.curve_secret_file:
        if env.curve_server_key or env.curve_allowed_keys:
            raise ValueError("NCCLKV_CURVE_SERVER_KEY/ALLOWED_KEYS go with NCCLKV_CURVE_SECRET_KEY, not the _FILE variables")
        curve = load_curve_files(env.curve_secret_file, env.curve_public_file or None, env.curve_allowed_dir or None)
    elif env.curve_secret_key:
        if env.curve_public_file or env.curve_allowed_dir:
            raise ValueError("NCCLKV_CURVE_PUBLIC_FILE/ALLOWED_DIR go with NCCLKV_CURVE_SECRET_FILE, not the _KEY variables")
        allowed = {k.strip().encode() for k in env.curve_allowed_keys.split(",") if k.strip()} or None
        curve = CurveConfig.from_secret_key(
            env.curve_secret_key.strip(), server_key=env.curve_server_key.strip() or None, allowed_clients=allowed
        )
    elif env.curve_public_file or env.curve_allowed_dir or env.curve_server_key or env.curve_allowed_keys:
        raise ValueError("CURVE keys or allowed clients are set but no CURVE secret key: set NCCLKV_CURVE_SECRET_FILE")
    if env.shared_secret_file and env.shared_secret:
        raise ValueError("set NCCLKV_SHARED_SECRET_FILE or NCCLKV_SHARED_SECRET, not both")
    secret: bytes | None = None
    if env.shared_secret_file:
        secret = load_shared_secret(env.shared_secret_file)
    elif env.shared_secret:
        secret = env.shared_secret.strip().encode()
    return ChannelAuth(curve=curve, shared_secret=secret)
