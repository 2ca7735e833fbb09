"""Who may write to a multi-node run's store: only the holders of the run's secret.

A multi-node run passes everything through the rendezvous TCPStore, which any process that
reaches its port can read and write. The notebook kernel reads from it, and the kernel holds the
user's credentials, so nothing read from the store is trusted until it is verified:

- the notebook makes a **secret per run** (or takes ``NBLAUNCH_RUN_SECRET`` when the user set one,
  so that join commands started before the cell can know it). Joining nodes get it from that
  variable in the printed join command, or from a ``0600`` file under ``~/.nblaunch/secrets/``
  (found by itself on a shared home directory). Neither shows in another user's ``ps``;
- **records** (the settings, the payload, node announcements, event batches) are pickled and
  sealed with AES-GCM (the ``cryptography`` package): encrypted, so a reader of the store learns
  nothing of the function or of what ranks print, and authenticated, with the store key as
  associated data, so a record cannot be forged, altered, or moved to another key. Nothing is
  unpickled before it is opened;
- **control values** (``ok``/``stop``/``interrupt``, the rendezvous outcome) are plain text with
  an HMAC-SHA256;
- **torch's rendezvous state**, which torch unpickles, is signed too: the rendezvous backend gets
  a :class:`SigningStore`.

What an outsider on the network can still do is deny service (delete keys, fill queues, close
the port): that is seen and reported, never silent, but not prevented.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import pickle
import secrets
from pathlib import Path
from typing import Any

from nblaunch.errors import AuthenticationError

SECRET_ENV = "NBLAUNCH_RUN_SECRET"
# Sealed records start with this, so a record of another format is told apart at once.
RECORD_MAGIC = b"nbl1"
_NONCE_BYTES = 12
_SIGNATURE_HEX = 64


def secret_dir() -> Path:
    """Where secret files go: ``~/.nblaunch/secrets`` (``NBLAUNCH_SECRET_DIR`` moves it)."""
    return Path(os.environ.get("NBLAUNCH_SECRET_DIR") or Path.home() / ".nblaunch" / "secrets")


class RunSecret:
    """The run's shared secret, and the keys derived from it for sealing and signing.

    Parameters
    ----------
    secret
        A string of at least 32 characters (``RunSecret.new()`` makes one).
    """

    def __init__(self, secret: str) -> None:
        if len(secret) < 32:
            raise AuthenticationError(
                f"{SECRET_ENV} must be at least 32 characters (a random string, e.g. from "
                "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
            )
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self.text = secret
        raw = secret.encode()
        self._aead = AESGCM(hmac.digest(raw, b"nblaunch record key", hashlib.sha256))
        self._mac_key = hmac.digest(raw, b"nblaunch signing key", hashlib.sha256)

    @classmethod
    def new(cls) -> RunSecret:
        """The user's ``NBLAUNCH_RUN_SECRET`` if set, else a fresh random secret."""
        return cls(os.environ.get(SECRET_ENV) or secrets.token_urlsafe(32))

    # --- records --------------------------------------------------------------------------------

    def seal(self, value: Any, key: str) -> bytes:
        """Pickle ``value`` and encrypt it for the store key ``key``."""
        nonce = secrets.token_bytes(_NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, pickle.dumps(value), key.encode())
        return RECORD_MAGIC + nonce + sealed

    def open(self, data: bytes, key: str) -> Any:
        """The value sealed for ``key``; unpickled only once it is known to be ours.

        Raises
        ------
        AuthenticationError
            ``data`` was not sealed with this secret for this key (forged, altered, moved).
        """
        from cryptography.exceptions import InvalidTag

        if not data.startswith(RECORD_MAGIC) or len(data) < len(RECORD_MAGIC) + _NONCE_BYTES:
            raise AuthenticationError(f"a record under {key} is not sealed with the run's secret")
        start = len(RECORD_MAGIC)
        nonce, sealed = data[start : start + _NONCE_BYTES], data[start + _NONCE_BYTES :]
        try:
            plain = self._aead.decrypt(nonce, sealed, key.encode())
        except InvalidTag:
            raise AuthenticationError(
                f"a record under {key} failed authentication (forged, altered, or sealed with "
                "another secret)"
            ) from None
        return pickle.loads(plain)

    # --- signed text ----------------------------------------------------------------------------

    def sign(self, text: str | bytes, key: str) -> bytes:
        """``text`` with an HMAC over it and ``key``: readable, but not forgeable."""
        body = text.encode() if isinstance(text, str) else text
        return self._mac(body, key).encode() + b"." + body

    def verify(self, data: bytes, key: str) -> bytes:
        """The text of a value signed for ``key``.

        Raises
        ------
        AuthenticationError
            The signature does not match (forged or altered, or another secret).
        """
        mac, dot, body = data.partition(b".")
        if (
            dot
            and len(mac) == _SIGNATURE_HEX
            and hmac.compare_digest(mac, self._mac(body, key).encode())
        ):
            return body
        raise AuthenticationError(f"the value under {key} failed authentication")

    def _mac(self, body: bytes, key: str) -> str:
        return hmac.new(self._mac_key, key.encode() + b"\0" + body, hashlib.sha256).hexdigest()

    # --- the secret file ------------------------------------------------------------------------

    def write_file(self, run_id: str) -> Path:
        """Write the secret to ``secret_dir()/<run id>``, readable by this user only."""
        directory = secret_dir()
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = directory / run_id
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(self.text)
        return path


def remove_secret_file(run_id: str) -> None:
    with contextlib.suppress(OSError):
        (secret_dir() / run_id).unlink()


def secret_for_join(run_id: str, secret_file: str | None = None) -> RunSecret:
    """On a joining node: the secret from ``--secret-file``, ``NBLAUNCH_RUN_SECRET``, or the
    notebook's own file (a shared home directory).

    Raises
    ------
    AuthenticationError
        None of them is there, saying where to get it.
    """
    if secret_file:
        return RunSecret(Path(secret_file).read_text().strip())
    if os.environ.get(SECRET_ENV):
        return RunSecret(os.environ[SECRET_ENV])
    path = secret_dir() / run_id
    if path.exists():
        return RunSecret(path.read_text().strip())
    raise AuthenticationError(
        f"no secret for run {run_id}: run the join command exactly as the notebook printed it "
        f"(it sets {SECRET_ENV}), or pass --secret-file with a copy of {path} from the "
        "notebook's machine"
    )


class SigningStore:
    """The store as torch's c10d rendezvous backend sees it: every value it writes is signed,
    every value it reads is verified before torch unpickles it.

    The backend uses ``get`` and ``compare_set`` only. Signatures are deterministic, so the value
    the backend expects in a compare-and-set is signed the same way as it was stored.
    """

    def __init__(self, store: Any, secret: RunSecret, endpoint: str) -> None:
        self._store = store
        self._secret = secret
        self._endpoint = endpoint

    def get(self, key: str) -> bytes:
        return self._checked(key, self._store.get(key))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        # "" means "no value yet" to the store: it stays unsigned.
        signed_expected = self._secret.sign(expected, key) if expected else expected
        current = self._store.compare_set(key, signed_expected, self._secret.sign(desired, key))
        return self._checked(key, current)

    def _checked(self, key: str, value: bytes) -> bytes:
        try:
            return self._secret.verify(value, key)
        except AuthenticationError:
            raise AuthenticationError(
                f"the rendezvous at {self._endpoint} failed authentication: another client is "
                "writing to it (or a node uses another secret). Run on a private network, or "
                "check who else reaches that port."
            ) from None
