"""Where the admission signing keys live (controlplane/service/signing.py;
docs/ha.md, "Signed admissions").

One table, ``admission_keys``: a generation number and 32 random bytes.
The first server to start on a database creates generation 1; every
replica and every restart reads the same rows, so a token one replica
signed verifies on any other and after a restart (SQLite: the embedded
database holds its own). ``rotate`` adds the next generation: the servers
sign with it from their next config poll and still accept the one before,
so tokens issued just before the rotation stay good; the generation before
that stops verifying.

The ``admission_signing_key`` setting (and ``..._previous``) overrides the
table: then every replica must be given the same values.
"""

from __future__ import annotations

import os

from sqlalchemy import Engine, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controlplane.settings import Settings
from controlplane.store.models import AdmissionKeyRow

KEY_BYTES = 32  # as service/signing.py takes them (HMAC-SHA256's block of security)


def load_keys(engine: Engine) -> list[bytes]:
    """The current key, then the previous one (when there is one); the
    first key is created when there is none."""
    keys = _newest(engine)
    if not keys:
        _insert(engine, 1)  # two replicas starting at once: one insert wins
        keys = _newest(engine)
    return keys


def rotate(engine: Engine) -> int:
    """Add the next key generation; returns its number. A rotation that
    races another adds one generation, not two."""
    with Session(engine) as s:
        top = s.scalar(select(func.max(AdmissionKeyRow.generation))) or 0
    _insert(engine, top + 1)
    return top + 1


def signing_keys(settings: Settings, engine: Engine) -> list[bytes]:
    """The keys a server signs and verifies with: the settings' when set,
    else the database's."""
    if settings.admission_signing_key is not None:
        keys = [settings.admission_signing_key.get_secret_value()]
        if settings.admission_signing_key_previous is not None:
            keys.append(settings.admission_signing_key_previous.get_secret_value())
        return [bytes.fromhex(k) for k in keys]
    return load_keys(engine)


def _newest(engine: Engine) -> list[bytes]:
    with Session(engine) as s:
        rows = s.scalars(
            select(AdmissionKeyRow.secret).order_by(AdmissionKeyRow.generation.desc()).limit(2)
        )
        return [bytes(r) for r in rows]


def _insert(engine: Engine, generation: int) -> None:
    try:
        with Session(engine) as s, s.begin():
            s.add(AdmissionKeyRow(generation=generation, secret=os.urandom(KEY_BYTES)))
    except IntegrityError:
        pass  # another server or rotation wrote this generation first: theirs stands
