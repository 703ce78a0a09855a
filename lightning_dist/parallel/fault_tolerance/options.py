"""The ``fault_tolerance`` option: which replica group this job is, how many there are, and where the lighthouse is.

Every field may come from the environment instead (so that one script serves every group, each launched with its
own variables): ``TORCHFT_LIGHTHOUSE`` (torchft's own), ``LIGHTNING_DIST_REPLICA_GROUP_ID`` and
``LIGHTNING_DIST_NUM_REPLICA_GROUPS``. A value given explicitly wins over the environment.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_dist.parallel.validation import is_positive_int

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
REPLICA_GROUP_ID_ENV = "LIGHTNING_DIST_REPLICA_GROUP_ID"
NUM_REPLICA_GROUPS_ENV = "LIGHTNING_DIST_NUM_REPLICA_GROUPS"


@dataclass(frozen=True)
class FaultToleranceOptions:
    """Train through the failure of whole replica groups with torchft (see docs/fault_tolerance.md).

    Args:
        replica_group_id: This job's replica group, ``0 ≤ id < num_replica_groups`` (``LIGHTNING_DIST_REPLICA_GROUP_ID``).
        num_replica_groups: Replica groups in all (``LIGHTNING_DIST_NUM_REPLICA_GROUPS``); the data is split over
            all of them.
        min_replica_groups: A step commits only when at least this many groups took part in it.
        lighthouse: The torchft lighthouse, ``http://host:port`` (``TORCHFT_LIGHTHOUSE``).
        connect_timeout: Seconds to reach the lighthouse and the group's manager before failing.
        join_timeout: Seconds the first step of a cold start waits for all ``num_replica_groups`` groups; after it
            the groups present start, and the others heal from them when they come. A group that starts while
            others train joins them at once.
        quorum_timeout: Seconds a step waits for its quorum (a group that died is dropped after the lighthouse's
            heartbeat timeout, well within it).
        timeout: Seconds for a collective across groups and for the transfer of the live state to a healing group.
    """

    replica_group_id: int | None = None
    num_replica_groups: int | None = None
    min_replica_groups: int = 1
    lighthouse: str | None = None
    connect_timeout: float = 10.0
    join_timeout: float = 60.0
    quorum_timeout: float = 60.0
    timeout: float = 60.0

    @classmethod
    def from_env(cls, **given: Any) -> FaultToleranceOptions:
        """The options ``given``, with the ones left out (or ``None``) read from the environment, checked."""
        environment = {
            "replica_group_id": _int_env(REPLICA_GROUP_ID_ENV),
            "num_replica_groups": _int_env(NUM_REPLICA_GROUPS_ENV),
            "lighthouse": os.environ.get(LIGHTHOUSE_ENV) or None,
        }
        values = {k: v for k, v in environment.items() if v is not None}
        values.update({k: v for k, v in given.items() if v is not None})
        return cls(**values).checked()

    def checked(self) -> FaultToleranceOptions:
        """``self`` once every field is known and consistent; else a ``ValueError`` naming the field and the fix."""
        for name, env in (
            ("num_replica_groups", NUM_REPLICA_GROUPS_ENV),
            ("replica_group_id", REPLICA_GROUP_ID_ENV),
            ("lighthouse", LIGHTHOUSE_ENV),
        ):
            if getattr(self, name) is None:
                raise ValueError(
                    f"fault_tolerance: {name} is not set. Give it in the option (fault_tolerance={{'{name}': ...}})"
                    f" or in the environment variable {env}, set differently for each replica group's job."
                )
        if not is_positive_int(self.num_replica_groups):
            raise ValueError(f"fault_tolerance: num_replica_groups={self.num_replica_groups!r} must be a positive int.")
        group = self.replica_group_id
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < self.num_replica_groups:
            raise ValueError(
                f"fault_tolerance: replica_group_id={group!r} is outside num_replica_groups={self.num_replica_groups}:"
                f" give each group's job an id in 0..{self.num_replica_groups - 1} (LIGHTNING_DIST_REPLICA_GROUP_ID)."
            )
        if not is_positive_int(self.min_replica_groups) or self.min_replica_groups > self.num_replica_groups:
            raise ValueError(
                f"fault_tolerance: min_replica_groups={self.min_replica_groups!r} must be an int in"
                f" 1..num_replica_groups={self.num_replica_groups}."
            )
        if not str(self.lighthouse).startswith(("http://", "https://")):
            raise ValueError(
                f"fault_tolerance: lighthouse={self.lighthouse!r} is not an address like 'http://host:29510' (the"
                " torchft lighthouse's, as `torchft_lighthouse --bind [::]:29510` prints it)."
            )
        for name in ("connect_timeout", "join_timeout", "quorum_timeout", "timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"fault_tolerance: {name}={value!r} must be a positive number of seconds.")
        return self

    @property
    def replica_id(self) -> str:
        """This group's id for torchft (which reads the group's index from its trailing digits)."""
        return f"lightning_dist_{self.replica_group_id}"


def resolve_fault_tolerance(
    value: FaultToleranceOptions | Mapping[str, Any] | bool | None,
) -> FaultToleranceOptions | None:
    """The ``fault_tolerance`` option as given (a :class:`FaultToleranceOptions`, a dict of its fields, ``True``: all
    from the environment, ``None``/``False``: off), with the environment filled in and checked."""
    if value is None or value is False:
        return None
    if value is True:
        return FaultToleranceOptions.from_env()
    if isinstance(value, FaultToleranceOptions):
        return FaultToleranceOptions.from_env(**dataclasses.asdict(value))
    if isinstance(value, Mapping):
        known = {f.name for f in dataclasses.fields(FaultToleranceOptions)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"fault_tolerance has no field {', '.join(map(repr, unknown))}; its fields are {sorted(known)}."
            )
        return FaultToleranceOptions.from_env(**value)
    raise TypeError(
        f"fault_tolerance={value!r}: pass a dict such as {{'replica_group_id': 0, 'num_replica_groups': 2,"
        " 'lighthouse': 'http://host:29510'}, a FaultToleranceOptions, or True to read everything from the environment."
    )


def _int_env(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer.") from None
