"""Who and where each rank is: the table that turns "rank 1" into a machine an on-call engineer can drain.

A rank number alone does not say which machine to look at, and under
``DistributedDataParallel(process_group=subgroup)`` it is the rank inside the group, not the job's.
When a state binds, every rank of the data-parallel group sends its ``RankIdentity`` in the same
gather that checks the settings agree (``ddphooks.state.agree_across_ranks``: one collective, in
the same place on every rank), so every rank holds the same table, indexed by the rank in the
group. Records carry it (the first record and every detailed one: ``identity``), and every alert
names its rank with it (``name_alert``): ``global rank 3 (rank 1 of its group) on host-a, cuda:1
(GPU-8f2c...)``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the table is read offline too (``ddphooks.detect``): torch only where a rank is described
    import torch


@dataclass(frozen=True)
class RankIdentity:
    """One rank of the data-parallel group: where it runs and on what."""

    global_rank: int
    """Its rank in the whole job (``torch.distributed.get_rank()``)."""
    group_rank: int
    """Its rank in the model's data-parallel group: the index of the records' per-rank lists and
    of an alert's ``rank``."""
    host: str
    """``socket.gethostname()`` of its process."""
    local_rank: int | None
    """``LOCAL_RANK`` as torchrun (and most launchers) set it; None where it is not set."""
    pid: int
    """Its process id on ``host``."""
    device: str
    """The device its model's gradients are on: ``cuda:1``, ``npu:0``, ``cpu``."""
    device_uuid: str | None = None
    """The accelerator's UUID as ``nvidia-smi -L`` prints it (``GPU-...``), where torch exposes it."""
    pci_bus_id: str | None = None
    """The accelerator's PCI bus id (``00000000:41:00.0``, as ``nvidia-smi`` prints it), where torch exposes it."""

    def describe(self, subgroup: bool) -> str:
        """The rank for a person: ``global rank 3 (rank 1 of its group) on host-a, cuda:1 (GPU-8f2c...)``;
        ``subgroup=False`` (the group is the whole job) leaves out the rank in the group."""
        rank = f"global rank {self.global_rank}" + (f" (rank {self.group_rank} of its group)" if subgroup else "")
        device = self.device + (f" ({self.device_uuid})" if self.device_uuid else "")
        return f"{rank} on {self.host}, {device}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> RankIdentity:
        return cls(**{name: values.get(name) for name in cls.__dataclass_fields__})


def model_device(model: torch.nn.Module | None) -> torch.device:
    """The device a rank's gradients are on: its model's first parameter's, else the process's
    current accelerator (a state bound before its model is known), else the CPU."""
    import torch

    if model is not None:
        for parameter in model.parameters():
            return parameter.device
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if accelerator is not None and accelerator.type != "cpu":
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
    return torch.device("cpu")


def local_identity(global_rank: int, group_rank: int, device: torch.device) -> RankIdentity:
    """This process's ``RankIdentity`` (no collective)."""
    local_rank = os.environ.get("LOCAL_RANK")
    uuid, bus = _accelerator_ids(device)
    index = device.index if device.index is not None or device.type == "cpu" else 0
    return RankIdentity(
        global_rank=global_rank,
        group_rank=group_rank,
        host=socket.gethostname(),
        local_rank=int(local_rank) if local_rank is not None and local_rank.isdigit() else None,
        pid=os.getpid(),
        device="cpu" if device.type == "cpu" else f"{device.type}:{index}",
        device_uuid=uuid,
        pci_bus_id=bus,
    )


def _accelerator_ids(device: torch.device) -> tuple[str | None, str | None]:
    """The UUID and PCI bus id of ``device`` where torch exposes them (CUDA: the device's
    properties; other backends: None). Never raises: a name is better than no binding."""
    if device.type != "cuda":
        return None, None
    import torch

    try:
        properties = torch.cuda.get_device_properties(device.index if device.index is not None else torch.cuda.current_device())
    except Exception:
        return None, None
    uuid = getattr(properties, "uuid", None)
    uuid = None if uuid is None else (str(uuid) if str(uuid).startswith("GPU-") else f"GPU-{uuid}")
    try:
        bus = f"{properties.pci_domain_id:08x}:{properties.pci_bus_id:02x}:{properties.pci_device_id:02x}.0"
    except AttributeError:  # a torch without the PCI fields
        bus = None
    return uuid, bus


class RankTable:
    """The data-parallel group's identities, the same on every rank (index: rank in the group).

    Args:
        identities: one per rank of the group, in group order.
        subgroup: whether the group is a subgroup of the job (alerts then say both ranks).

    Example::
        >>> table = RankTable([RankIdentity(2, 0, "host-a", 0, 11, "cpu"), RankIdentity(3, 1, "host-b", 0, 12, "cpu")], subgroup=True)
        >>> table.name_alert({"rank": 1, "message": "rank 1 has diverged since step 100: ..."})["message"]
        'global rank 3 (rank 1 of its group) on host-b, cpu: rank 1 has diverged since step 100: ...'
    """

    def __init__(self, identities: list[RankIdentity], subgroup: bool) -> None:
        self.identities = list(identities)
        self.subgroup = subgroup

    @classmethod
    def from_record(cls, record: dict) -> RankTable | None:
        """The table a record carries (``identity``: the columns ``to_record`` writes, or a list
        of ``RankIdentity`` dicts), None where it carries none or cannot be read."""
        carried = record.get("identity")
        try:
            if isinstance(carried, dict):
                identities = _from_columns(carried)
            elif isinstance(carried, list) and carried:
                identities = [RankIdentity.from_dict(row) for row in carried]
            else:
                return None
        except (TypeError, ValueError, IndexError, KeyError):  # a malformed table names no rank, never breaks a reader
            return None
        if not identities:
            return None
        return cls(identities, subgroup=any(i.global_rank != i.group_rank for i in identities) or "global_ranks" in record)

    def to_record(self) -> dict:
        """The table as a record carries it: one list per field, in group order, the strings that
        repeat (hosts, devices, PCI bus ids) as indices into a list of the distinct values. At
        W = 4096 it is about 120 KB on CPUs (with GPU UUIDs, about 300 KB) where a dict per rank
        was 620 KB; ``from_record`` reads it back.

        Example::
            >>> RankTable([RankIdentity(0, 0, "a", 0, 7, "cpu"), RankIdentity(1, 1, "a", 1, 8, "cpu")], False).to_record()["host"]
            [0, 0]
        """
        columns: dict = {}
        for name in ("global_rank", "local_rank", "pid", "device_uuid"):
            columns[name] = [getattr(identity, name) for identity in self.identities]
        for name, values in (("host", "hosts"), ("device", "devices"), ("pci_bus_id", "pci_bus_ids")):
            distinct = list(dict.fromkeys(getattr(identity, name) for identity in self.identities if getattr(identity, name) is not None))
            where = {value: index for index, value in enumerate(distinct)}
            columns[values] = distinct
            columns[name] = [where.get(getattr(identity, name)) for identity in self.identities]
        return columns

    def hosts(self) -> list[str]:
        """Each rank's host, in group order."""
        return [identity.host for identity in self.identities]

    def describe(self, rank: int) -> str | None:
        """Rank ``rank`` of the group for a person (None where the table has no such rank)."""
        return self.identities[rank].describe(self.subgroup) if 0 <= rank < len(self.identities) else None

    def describe_ranks(self, ranks: list[int]) -> str:
        """Several ranks of the group for a person: ``global ranks 0, 1, 2 on host-a, host-b``
        (the first 8 listed, then how many more)."""
        identities = [self.identities[rank] for rank in ranks]
        listed = ", ".join(str(i.global_rank) for i in identities[:8]) + (f" and {len(identities) - 8} more" if len(identities) > 8 else "")
        in_group = f" (ranks {', '.join(str(rank) for rank in ranks[:8])}{' ...' if len(ranks) > 8 else ''} of its group)" if self.subgroup else ""
        hosts = sorted({i.host for i in identities})
        return f"global ranks {listed}{in_group} on {', '.join(hosts[:8])}{f' and {len(hosts) - 8} more hosts' if len(hosts) > 8 else ''}"

    def name_alert(self, alert: dict) -> dict:
        """``alert`` with its rank named: ``global_rank``, ``host``, ``device``, ``device_uuid``,
        ``where`` added and ``where`` put before its message; an alert about several ranks
        (``ranks``: ``duplicate_data``) also gets their ``global_ranks`` and ``where`` names them
        all. An alert named already, or whose ranks the table does not hold, is returned as it is."""
        rank, ranks = alert.get("rank"), alert.get("ranks")
        if "where" in alert or not self._holds(rank) or (ranks is not None and not all(self._holds(r) for r in ranks)):
            return alert
        identity = self.identities[rank]
        where = identity.describe(self.subgroup) if ranks is None else self.describe_ranks(ranks)
        named = dict(alert, global_rank=identity.global_rank, host=identity.host, device=identity.device, device_uuid=identity.device_uuid, where=where)
        if ranks is not None:
            named["global_ranks"] = [self.identities[r].global_rank for r in ranks]
        named["message"] = f"{where}: {alert.get('message', '')}"
        return named

    def _holds(self, rank: object) -> bool:
        return isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < len(self.identities)


def _from_columns(columns: dict) -> list[RankIdentity]:
    """``RankTable.to_record``'s columns back into one ``RankIdentity`` per rank."""
    def looked_up(name: str, values: str) -> list:
        table = columns[values]
        return [None if index is None else table[index] for index in columns[name]]

    hosts, devices, buses = looked_up("host", "hosts"), looked_up("device", "devices"), looked_up("pci_bus_id", "pci_bus_ids")
    return [
        RankIdentity(global_rank, group_rank, host, local_rank, pid, device, uuid, bus)
        for group_rank, (global_rank, host, local_rank, pid, device, uuid, bus) in enumerate(
            zip(columns["global_rank"], hosts, columns["local_rank"], columns["pid"], devices, columns["device_uuid"], buses, strict=True)
        )
    ]

