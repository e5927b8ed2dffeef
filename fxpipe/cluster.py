"""cluster: the machines a plan is for — accelerators, their memory and FLOP/s, and the links between them.

A :class:`Cluster` is ``nodes`` identical nodes of ``per_node`` accelerators each. Inside a node
accelerators talk over the ``intra`` link (NVLink); between nodes over the ``inter`` link, the
node's network interfaces, whose bandwidth is the node's total and is shared by every flow
leaving the node at once::

    cluster = fxpipe.Cluster.preset("p3.16xlarge", nodes=8)    # PipeDream-2BW's 64 V100-16GB
    plan = fxpipe.plan(model, example_inputs, cluster=cluster, global_batch=512,
                       schedule="2bw", precision="fp16")
    print(plan)                                                # stages, placement, the search

Placement is the plan's, and the runtime follows it (``Plan.layout``,
:func:`fxpipe.schedule.rank_of`): replica-major, rank ``replica * d + stage`` (a node holds whole
replicas), or stage-major, rank ``stage * w + replica`` (a stage's replicas share a node); on
node ``rank // per_node`` (torchrun numbers ranks node by node). The planner prices both where
they differ and keeps the faster. A plan for N < size accelerators uses the first N ranks. What
the planner prices on a layout:

* **Activations between stages s and s+1** use the intra link when every replica's two ranks
  share a node, else the inter link, its bandwidth divided among the flows that leave the node
  at once (replicas run in lockstep, so the most crowded replica sets the pace), and one flow
  never gets more than one of the node's ``nics`` interfaces (a GPU sends through the NIC
  beside it: on a DGX A100 one of eight 200 Gbit/s NICs, 25 GB/s, not the node's 200 GB/s). With
  ``overlap_p2p`` (the presets: NCCL's sends run beside compute) a stage costs the larger of its
  compute and its link time per micro-batch, else their sum (this machine's CPU ranks).
* **A ring all-reduce** among ``k`` ranks moves ``2(k-1)/k`` of the data over each hop of the
  ring and pays ``2(k-1)`` latencies. It runs at the pace of the slowest hop: the intra link
  when the group sits in one node, else the node's interface divided among the groups that
  leave that node at the same time (a 2bw step reduces every stage's gradients in the same
  window, so on a node holding 8 stages 8 rings share the interface). See
  :meth:`Cluster.allreduce_time`.

Compute: ``flops[dtype]`` is the vendor's peak dense FLOP/s and ``efficiency`` the fraction a
training step sustains (``achievable_flops``); :meth:`Cluster.with_efficiency` replaces the
fraction with a measured one (:meth:`Cluster.calibrate` measures it on a local accelerator).
``memory`` is each accelerator's capacity and ``reserved`` what the CUDA context, NCCL buffers
and the allocator's slack take from it; plans fill ``memory - reserved``.

Files (:meth:`Cluster.from_file`) are JSON or TOML with the same keys as :meth:`to_dict`, sizes
in GB (1e9 bytes) and GB/s, e.g. ``my.toml``::

    name = "my-cluster"
    nodes = 4
    per_node = 8
    memory_gb = 40
    mem_bandwidth_gbs = 1555
    efficiency = 0.5
    [flops_tflops]
    fp32 = 19.5
    bf16 = 312
    fp16 = 312
    [intra]
    bandwidth_gbs = 300
    latency_us = 5
    [inter]
    bandwidth_gbs = 100
    latency_us = 5

``nics`` (default 1) is how many interfaces share ``inter``'s bandwidth; ``overlap_p2p``,
``reserved_gb``, ``op_latency_us`` and ``intra_allreduce_bandwidth_gbs`` are optional too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from .errors import PlanError
from .schedule import rank_of

__all__ = ["Link", "Cluster", "PRESETS", "placement", "stage_links", "crossing_stages"]

_G = 1e9
_T = 1e12

#: dtype names a cluster's ``flops`` may hold, and the precision they serve
DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16")
_PRECISION_DTYPE = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


@dataclass(frozen=True)
class Link:
    """One kind of link: bytes per second in each direction, seconds of fixed cost per message."""

    bandwidth: float
    latency: float = 0.0

    def time(self, nbytes: float) -> float:
        """Seconds to move one message of ``nbytes`` over the link."""
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Cluster:
    """Nodes of identical accelerators and the links between them (see the module docstring)."""

    name: str
    nodes: int
    per_node: int  #: accelerators per node
    memory: float  #: bytes of memory per accelerator
    flops: Mapping[str, float]  #: peak dense FLOP/s per dtype ("fp32", "tf32", "bf16", "fp16", "fp64")
    mem_bandwidth: float  #: accelerator memory bytes/s (the roofline's memory roof)
    intra: Link  #: between two accelerators of one node
    inter: Link  #: a node's network interfaces (all of them: the node's total), shared by its flows
    efficiency: float = 0.5  #: fraction of ``flops`` a training step sustains
    reserved: float = 0.0  #: bytes per accelerator the plan may not fill (CUDA context, NCCL, slack)
    op_latency: float = 5e-6  #: seconds of fixed dispatch cost per operator
    accelerator: str = ""  #: e.g. "V100-SXM2-16GB"
    intra_allreduce_bandwidth: float | None = None  #: ring bus bytes/s inside a node (None: intra.bandwidth)
    #: stage-to-stage sends run beside compute (GPUs: NCCL's copy engines and its own stream), so
    #: a stage's per-micro-batch time is the larger of its compute and its link time, not their
    #: sum; False for this machine as measured (CPU ranks: gloo's copies share the cores)
    overlap_p2p: bool = True
    #: network interfaces per node, sharing ``inter.bandwidth`` equally: one stage-to-stage flow
    #: uses one of them (an all-reduce's rings are spread over all)
    nics: int = 1

    def __post_init__(self) -> None:
        def bad(what: str, expected: str, found: Any, fix: str) -> None:
            raise PlanError(f"Cluster {self.name!r}: {what} must be {expected}, found {found!r}; {fix}")

        for name in ("nodes", "per_node", "nics"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(name, "a positive integer", v, f"pass e.g. {name}=8")
        for name in ("memory", "mem_bandwidth", "efficiency"):
            v = getattr(self, name)
            if not _number(v) or v <= 0:
                bad(name, "a positive number", v, "see Cluster.preset(...) for typical values")
        if self.efficiency > 1:
            bad("efficiency", "a fraction of the peak in (0, 1]", self.efficiency, "pass e.g. efficiency=0.4")
        for name in ("reserved", "op_latency"):
            v = getattr(self, name)
            if not _number(v) or v < 0:
                bad(name, "a number >= 0", v, f"pass e.g. {name}=0")
        if self.reserved >= self.memory:
            bad("reserved", f"less than memory ({self.memory:.3g} bytes)", self.reserved,
                "reserve what the CUDA context and NCCL take, about 1e9 bytes")
        if not isinstance(self.flops, Mapping) or not self.flops:
            bad("flops", f"a mapping of dtype to peak FLOP/s, dtypes among {DTYPES}", self.flops,
                "pass e.g. flops={'fp32': 15.7e12, 'fp16': 125e12}")
        for k, v in self.flops.items():
            if k not in DTYPES or not _number(v) or v <= 0:
                bad(f"flops[{k!r}]", f"a positive FLOP/s for a dtype among {DTYPES}", v,
                    "pass e.g. flops={'fp32': 15.7e12, 'fp16': 125e12}")
        object.__setattr__(self, "flops", dict(self.flops))
        for name in ("intra", "inter"):
            link = getattr(self, name)
            if not isinstance(link, Link) or not _number(link.bandwidth) or link.bandwidth <= 0 \
                    or not _number(link.latency) or link.latency < 0:
                bad(name, "a Link(bandwidth > 0 bytes/s, latency >= 0 s)", link,
                    f"pass e.g. {name}=Link(25e9, 10e-6)")
        if self.intra_allreduce_bandwidth is not None and (not _number(self.intra_allreduce_bandwidth)
                                                           or self.intra_allreduce_bandwidth <= 0):
            bad("intra_allreduce_bandwidth", "a positive number or None", self.intra_allreduce_bandwidth,
                "leave it None to use intra.bandwidth")

    def __hash__(self) -> int:  # ``flops`` is a dict: hash its items (a Plan holding a Cluster stays hashable)
        return hash((self.name, self.nodes, self.per_node, self.memory, tuple(sorted(self.flops.items())),
                     self.mem_bandwidth, self.intra, self.inter, self.efficiency, self.reserved, self.op_latency,
                     self.accelerator, self.intra_allreduce_bandwidth, self.overlap_p2p, self.nics))

    # ------------------------------------------------------------------------ constructors

    @classmethod
    def resolve(cls, spec, nodes: int | None = None) -> "Cluster | None":
        """A Cluster from a Cluster, a preset name or a path to a .json/.toml file (``nodes``: that
        many nodes of a preset or file; None: a preset's one, a file's own); None stays None."""
        if spec is None or isinstance(spec, Cluster):
            return spec
        if isinstance(spec, (str, os.PathLike)):
            spec = os.fspath(spec)
            if spec in PRESETS:
                return cls.preset(spec, nodes=nodes or 1)
            if spec.lower().endswith((".json", ".toml")):
                c = cls.from_file(spec)
                return dataclasses.replace(c, nodes=nodes) if nodes else c
            raise PlanError(f"cluster must be a preset in {sorted(PRESETS)} or a path to a .json or .toml file, found "
                            f"{spec!r}; e.g. cluster='p3.16xlarge' or fxpipe.Cluster.preset('p3.16xlarge', nodes=8)")
        raise PlanError(f"cluster must be a fxpipe.Cluster, a preset name or a file path, found {type(spec).__name__}; "
                        f"e.g. fxpipe.Cluster.preset('dgx-a100', nodes=2)")

    @classmethod
    def preset(cls, name: str, nodes: int = 1, **overrides: Any) -> "Cluster":
        """A cluster of ``nodes`` nodes of a known kind (:data:`PRESETS`): ``"p3.16xlarge"``,
        ``"dgx-a100"``, ``"dgx-h100"``. ``overrides`` replace fields (e.g. ``efficiency=0.35``)."""
        if name not in PRESETS:
            raise PlanError(
                f"unknown cluster preset {name!r}; expected one of {sorted(PRESETS)}, or a path to a .json or "
                f".toml file (fxpipe.Cluster.from_file); see fxpipe/cluster.py for the keys"
            )
        return dataclasses.replace(PRESETS[name], nodes=nodes, **overrides)

    @classmethod
    def from_device_model(cls, device, accelerators: int = 1) -> "Cluster":
        """The machine a :class:`fxpipe.cost.DeviceModel` describes, as one node of
        ``accelerators`` devices: p2p over its ``p2p_*`` figures, rings at its
        ``allreduce_bandwidth``. This is what :func:`fxpipe.plan` uses without ``cluster=``."""
        return cls(
            name=device.name, nodes=1, per_node=max(1, int(accelerators)), memory=device.memory_bytes,
            flops={"fp32": device.peak_flops}, mem_bandwidth=device.mem_bandwidth,
            intra=Link(device.p2p_bandwidth, device.p2p_latency),
            inter=Link(device.p2p_bandwidth, device.p2p_latency),
            efficiency=1.0, op_latency=device.op_latency, accelerator=device.name,
            intra_allreduce_bandwidth=device.allreduce_bandwidth, overlap_p2p=False,
        )

    @classmethod
    def local(cls, accelerators: int = 1, device: str | torch.device | None = None) -> "Cluster":
        """This machine as fxpipe measures it today (:meth:`fxpipe.cost.DeviceModel.for_device`)."""
        from .cost import DeviceModel

        return cls.from_device_model(DeviceModel.for_device(device), accelerators)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Cluster":
        """A cluster from a JSON or TOML file (keys of :meth:`to_dict`; see the module docstring)."""
        path = os.fspath(path)
        ext = os.path.splitext(path)[1].lower()
        if ext not in (".json", ".toml"):
            raise PlanError(f"cluster file {path!r}: expected a .json or .toml file, found extension {ext or '(none)'!r}; "
                            f"rename it or give a preset ({sorted(PRESETS)})")
        if not os.path.isfile(path):
            found = "is a folder" if os.path.isdir(path) else "does not exist"
            raise PlanError(f"cluster file {path!r} {found}; expected a .json or .toml file or a preset "
                            f"name ({sorted(PRESETS)})")
        toml = _toml(path) if ext == ".toml" else None
        try:
            if toml is None:
                with open(path) as f:
                    data = json.load(f)
            else:
                with open(path, "rb") as f:
                    data = toml.load(f)
        except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError and tomllib.TOMLDecodeError
            raise PlanError(f"cluster file {path!r} is not valid {ext[1:].upper()}: {e}; fix the syntax") from e
        try:
            return cls.from_dict(data)
        except PlanError as e:
            raise PlanError(f"cluster file {path!r}: {e}") from None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Cluster":
        """Inverse of :meth:`to_dict` (sizes in GB, bandwidths in GB/s, FLOP/s in TFLOP/s)."""
        if not isinstance(data, Mapping):
            raise PlanError(f"expected a table of cluster keys {sorted(_KEYS)}, found {type(data).__name__}")
        unknown = sorted(set(data) - set(_KEYS))
        missing = sorted(k for k in _REQUIRED if k not in data)
        if unknown or missing:
            raise PlanError(
                f"expected keys {sorted(_REQUIRED)} (optional: {sorted(set(_KEYS) - set(_REQUIRED))}); "
                + (f"missing {missing}" if missing else "")
                + ("; " if missing and unknown else "")
                + (f"unknown {unknown}" if unknown else "")
                + "; see the example in fxpipe/cluster.py"
            )

        # each value is checked here, in the file's units and words, before the Cluster's own
        # checks (which speak of bytes and Python) could see it
        def num(key: str, value: Any, scale: float, zero: bool = False) -> float:
            if not _number(value) or value < 0 or (value == 0 and not zero):
                expected = "a number >= 0" if zero else "a positive number"
                raise PlanError(f"{key} must be {expected}, found {value!r}; write e.g. {key} = 16")
            # microseconds divide (5 / 1e6 is the double 5e-6; 5 * 1e-6 is not)
            return float(value) / (1 / scale) if scale < 1 else float(value) * scale

        def link(key: str) -> Link:
            v = data[key]
            if not isinstance(v, Mapping) or "bandwidth_gbs" not in v or set(v) - {"bandwidth_gbs", "latency_us"}:
                raise PlanError(f"{key} must be a table with bandwidth_gbs (and latency_us), found {v!r}; "
                                f"write e.g. [{key}] bandwidth_gbs = 25, latency_us = 10")
            return Link(num(f"[{key}] bandwidth_gbs", v["bandwidth_gbs"], _G),
                        num(f"[{key}] latency_us", v.get("latency_us", 0), 1e-6, zero=True))

        flops = data["flops_tflops"]
        if not isinstance(flops, Mapping):
            raise PlanError(f"flops_tflops must be a table of dtype = TFLOP/s, found {flops!r}; write e.g. "
                            f"[flops_tflops] fp32 = 15.7, fp16 = 125")
        unknown_dtypes = sorted(str(k) for k in flops if k not in DTYPES)
        if unknown_dtypes:
            raise PlanError(f"[flops_tflops] has {unknown_dtypes}, expected dtypes among {list(DTYPES)}; "
                            f"write e.g. [flops_tflops] fp32 = 15.7, fp16 = 125")
        nodes, per_node, nics = data["nodes"], data["per_node"], data.get("nics", 1)
        for key, v in (("nodes", nodes), ("per_node", per_node), ("nics", nics)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"{key} must be a positive integer, found {v!r}; write e.g. {key} = 8")
        kw: dict[str, Any] = dict(
            name=str(data.get("name", "cluster")), nodes=nodes, per_node=per_node, nics=nics,
            memory=num("memory_gb", data["memory_gb"], _G),
            flops={str(k): num(f"[flops_tflops] {k}", v, _T) for k, v in flops.items()},
            mem_bandwidth=num("mem_bandwidth_gbs", data["mem_bandwidth_gbs"], _G),
            intra=link("intra"), inter=link("inter"),
            accelerator=str(data.get("accelerator", "")),
        )
        for key, fname, scale in (("efficiency", "efficiency", 1.0), ("reserved_gb", "reserved", _G),
                                  ("op_latency_us", "op_latency", 1e-6),
                                  ("intra_allreduce_bandwidth_gbs", "intra_allreduce_bandwidth", _G)):
            if key in data:
                kw[fname] = num(key, data[key], scale, zero=key in ("reserved_gb", "op_latency_us"))
        if kw.get("efficiency", 0.5) > 1:
            raise PlanError(f"efficiency must be a fraction of the peak in (0, 1], found {data['efficiency']!r}; "
                            f"write e.g. efficiency = 0.4")
        if kw.get("reserved", 0.0) >= kw["memory"]:
            raise PlanError(f"reserved_gb must be less than memory_gb ({data['memory_gb']!r}), found "
                            f"{data['reserved_gb']!r}; reserve what the CUDA context and NCCL take, about 1 GB: "
                            f"write e.g. reserved_gb = 1")
        if "overlap_p2p" in data:
            if not isinstance(data["overlap_p2p"], bool):
                raise PlanError(f"overlap_p2p must be true or false, found {data['overlap_p2p']!r}; write e.g. "
                                f"overlap_p2p = true (sends run beside compute, as NCCL's do)")
            kw["overlap_p2p"] = data["overlap_p2p"]
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """The cluster as plain data in the units of the file format (GB, GB/s, TFLOP/s, us)."""
        out: dict[str, Any] = {
            "name": self.name, "accelerator": self.accelerator, "nodes": self.nodes, "per_node": self.per_node,
            "memory_gb": self.memory / _G, "reserved_gb": self.reserved / _G,
            "flops_tflops": {k: v / _T for k, v in self.flops.items()},
            "efficiency": self.efficiency, "mem_bandwidth_gbs": self.mem_bandwidth / _G,
            "intra": {"bandwidth_gbs": self.intra.bandwidth / _G, "latency_us": self.intra.latency * 1e6},
            "inter": {"bandwidth_gbs": self.inter.bandwidth / _G, "latency_us": self.inter.latency * 1e6},
            "op_latency_us": self.op_latency * 1e6, "overlap_p2p": self.overlap_p2p, "nics": self.nics,
        }
        if self.intra_allreduce_bandwidth is not None:
            out["intra_allreduce_bandwidth_gbs"] = self.intra_allreduce_bandwidth / _G
        return out

    def check_memory(self, device_memory: float | None) -> None:
        """Raise a PlanError where ``device_memory`` (bytes a stage may fill, None: the usable
        memory) is more than one accelerator has."""
        if device_memory is not None and device_memory > self.memory:
            raise PlanError(
                f"device_memory {device_memory / _G:.1f} GB is more than the {self.memory / _G:.1f} GB each "
                f"{self.accelerator} of {self.name} has; pass at most {self.memory / _G:.1f} GB, or leave it out for "
                f"{self.usable_memory / _G:.1f} GB (its memory less a reserve of {self.reserved / _G:.1f} GB)"
            )

    def with_efficiency(self, efficiency: float) -> "Cluster":
        """This cluster with a measured fraction of peak (e.g. from :meth:`calibrate`)."""
        return dataclasses.replace(self, efficiency=efficiency)

    def calibrate(self, model, example_inputs, *, precision: str = "fp32",
                  device: str | torch.device | None = None, repeats: int = 5) -> "Cluster":
        """This cluster with ``efficiency`` measured on one local accelerator of its kind: every
        compute node of ``model`` runs forward on ``device`` (:func:`fxpipe.cost.annotate`,
        ``mode="measured"``), and the efficiency is the FLOPs of the matrix products divided by
        their time, over the peak for ``precision``'s dtype. Under bf16 or fp16 a copy of the
        model and its floating-point inputs in that dtype is timed, so the products run in it as
        they do under autocast. Run it where the accelerator is the cluster's (a V100 for a V100
        cluster); the figure replaces the preset's assumed one."""
        import copy

        import torch.utils._pytree as pytree

        from .cost import annotate
        from .trace import trace

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self.peak_flops(precision)  # a precision this cluster has a figure for, before timing anything
        if dtype is not None:
            model = copy.deepcopy(model).to(dtype)
            example_inputs = pytree.tree_map(
                lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, example_inputs)
        gm = trace(model, example_inputs)
        costs = annotate(gm, example_inputs, mode="measured", torch_device=device, repeats=repeats)
        flops = sum(c.flops(costs.batch_size) for c in costs.nodes.values() if c.flops.a or c.flops.c)
        secs = sum(c.fwd_time(costs.batch_size) for c in costs.nodes.values() if c.flops.a or c.flops.c)
        if flops <= 0 or secs <= 0:
            raise PlanError(f"calibrate: the model has no operator with known FLOPs (found {flops:.0f} FLOPs in "
                            f"{secs:.3g} s); calibrate with a model of matrix products (e.g. a transformer block)")
        return self.with_efficiency(min(1.0, flops / secs / self.peak_flops(precision)))

    # ---------------------------------------------------------------------------- figures

    @property
    def size(self) -> int:
        """Accelerators in the whole cluster."""
        return self.nodes * self.per_node

    @property
    def usable_memory(self) -> float:
        """Bytes a stage may fill on one accelerator."""
        return self.memory - self.reserved

    def peak_flops(self, precision: str = "fp32") -> float:
        """Vendor peak FLOP/s of one accelerator in ``precision``'s compute dtype."""
        dtype = _PRECISION_DTYPE.get(precision)
        if dtype is None:
            raise PlanError(f"precision must be one of {sorted(_PRECISION_DTYPE)}, found {precision!r}")
        if dtype not in self.flops:
            raise PlanError(
                f"cluster {self.name!r} ({self.accelerator or 'accelerator'}) has no FLOP/s for {dtype}: it "
                f"lists {sorted(self.flops)}; plan with precision in "
                f"{sorted(p for p, d in _PRECISION_DTYPE.items() if d in self.flops)} or add flops[{dtype!r}]"
            )
        return self.flops[dtype]

    def achievable_flops(self, precision: str = "fp32") -> float:
        """Sustained FLOP/s of one accelerator: peak x efficiency."""
        return self.peak_flops(precision) * self.efficiency

    def device_model(self, precision: str = "fp32"):
        """The :class:`fxpipe.cost.DeviceModel` that costs operators on one accelerator.

        Traced byte counts are those of the model's own dtype (fp32 here); under a 2-byte
        ``precision`` each operator moves half of them, so the memory roof is doubled instead."""
        from .cost import DeviceModel
        from .weights import compute_dtype

        low = compute_dtype(precision)
        scale = 1.0 if low is None else 32 / torch.finfo(low).bits
        return DeviceModel(
            name=f"{self.name} ({self.accelerator})" if self.accelerator and self.accelerator != self.name else self.name,
            memory_bytes=self.usable_memory, peak_flops=self.achievable_flops(precision),
            mem_bandwidth=self.mem_bandwidth * scale, p2p_bandwidth=self.intra.bandwidth,
            p2p_latency=self.intra.latency,
            allreduce_bandwidth=self.intra_allreduce_bandwidth or self.intra.bandwidth,
            op_latency=self.op_latency,
        )

    # -------------------------------------------------------------------------- placement

    def node_of(self, rank: int) -> int:
        """The node rank ``rank`` runs on (torchrun: ranks numbered node by node)."""
        return rank // self.per_node

    def check_fits(self, ranks: int) -> None:
        if ranks > self.size:
            raise PlanError(
                f"cluster {self.name!r} has {self.size} accelerators ({self.nodes} nodes x {self.per_node}), "
                f"found a request for {ranks}; use world_size <= {self.size} (fxpipe plan --world-size) or a cluster with "
                f"more nodes (--nodes)"
            )

    def ring_bandwidth(self, group: Sequence[int], concurrent: Sequence[Sequence[int]] = ()) -> float:
        """Bytes/s of each hop of a ring all-reduce over ``group``: the intra link inside one node;
        across nodes, the slowest node interface's share, each node's interface divided among the
        groups of ``concurrent`` (``group`` included or not) that have members on it and elsewhere.
        Each ring enters and leaves each of its nodes once, its members on a node being adjacent."""
        intra = self.intra_allreduce_bandwidth or self.intra.bandwidth
        nodes = {self.node_of(r) for r in group}
        if len(nodes) <= 1:
            return intra
        spanning = [set(map(self.node_of, g)) for g in concurrent]
        spanning = [s for s in spanning if len(s) > 1]
        mine = set(nodes)
        if not any(s == mine for s in spanning):
            spanning.append(mine)
        share = max(sum(1 for s in spanning if n in s) for n in nodes)
        return min(intra, self.inter.bandwidth / share)

    def allreduce_time(self, nbytes: float, group: Sequence[int], concurrent: Sequence[Sequence[int]] = ()) -> float:
        """Seconds of a ring all-reduce of ``nbytes`` over the ranks of ``group`` (0 for one rank):
        ``2(k-1)/k * nbytes / bw + 2(k-1) * latency``, with ``bw`` from :meth:`ring_bandwidth` and
        the latency of the slowest link crossed."""
        k = len(group)
        if k <= 1 or nbytes <= 0:
            return 0.0
        bw = self.ring_bandwidth(group, concurrent)
        crosses = len({self.node_of(r) for r in group}) > 1
        latency = max(self.intra.latency, self.inter.latency) if crosses else self.intra.latency
        return 2 * (k - 1) / k * nbytes / bw + 2 * (k - 1) * latency

    def describe(self) -> str:
        peak = ", ".join(f"{k} {v / _T:g}" for k, v in self.flops.items())
        return (
            f"{self.name}: {self.nodes} node(s) x {self.per_node} {self.accelerator or 'accelerators'} "
            f"({self.memory / _G:g} GB each, {self.reserved / _G:g} GB reserved; peak TFLOP/s {peak}; "
            f"efficiency {self.efficiency:g}); intra-node {self.intra.bandwidth / _G:g} GB/s, "
            f"inter-node {self.inter.bandwidth / _G:g} GB/s per node"
        )


def _toml(path: str):
    """The TOML reader: Python 3.11's ``tomllib``, or ``tomli`` (its backport) on 3.10."""
    import sys

    try:
        import tomllib

        return tomllib
    except ImportError:
        pass
    try:
        import tomli

        return tomli
    except ImportError:
        raise PlanError(
            f"cluster file {path!r}: reading TOML needs Python 3.11's tomllib or the tomli package, and this "
            f"Python {sys.version_info.major}.{sys.version_info.minor} has neither; write the same keys to a .json "
            f"file instead (json.dump(cluster.to_dict(), f) writes one), or pip install tomli"
        ) from None


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_REQUIRED = ("nodes", "per_node", "memory_gb", "flops_tflops", "mem_bandwidth_gbs", "intra", "inter")
_KEYS = (*_REQUIRED, "name", "accelerator", "efficiency", "reserved_gb", "op_latency_us",
         "intra_allreduce_bandwidth_gbs", "overlap_p2p", "nics")

# What the presets reserve per accelerator: the CUDA context (several hundred MB), NCCL's
# buffers and the caching allocator's fragmentation. An estimate, not a vendor figure.
_RESERVED = 1e9

#: The preset kinds of node (``nodes`` is set by :meth:`Cluster.preset`).
PRESETS: dict[str, Cluster] = {
    # AWS p3.16xlarge (the PipeDream-2BW paper's cluster, §5): 8 x Tesla V100-SXM2-16GB joined by
    # NVLink, 25 Gbit/s networking between instances (AWS EC2 P3 instance table).
    # V100 SXM2 (NVIDIA V100 datasheet): 7.8 fp64 / 15.7 fp32 / 125 tensor-core fp16 TFLOP/s,
    # 16 GB HBM2 at 900 GB/s, NVLink 2.0 at 25 GB/s per link each way (300 GB/s over six links,
    # both ways); neighbouring GPUs of the hybrid cube-mesh share one or two links: one is priced.
    # No bf16. Efficiency 0.30: a V100 sustains 39 TFLOP/s, 30% of peak, training an 1.2B GPT-2
    # (Megatron-LM, Shoeybi et al. 2019, arXiv 1909.08053). Latencies are assumed (NCCL over
    # NVLink ~10 us, TCP between instances ~50 us).
    "p3.16xlarge": Cluster(
        name="p3.16xlarge", accelerator="V100-SXM2-16GB", nodes=1, per_node=8, memory=16e9, reserved=_RESERVED,
        flops={"fp64": 7.8e12, "fp32": 15.7e12, "fp16": 125e12}, mem_bandwidth=900e9,
        intra=Link(25e9, 10e-6), inter=Link(25e9 / 8, 50e-6), efficiency=0.30,
    ),
    # NVIDIA DGX A100 (DGX A100 datasheet): 8 x A100-SXM4-80GB on NVSwitch (NVLink 3: 600 GB/s per
    # GPU both ways, 300 each way), 8 x 200 Gbit/s HDR InfiniBand (ConnectX-6) for compute traffic:
    # 200 GB/s per node. A100 (NVIDIA A100 datasheet): 9.7 fp64 / 19.5 fp32 / 156 tf32 /
    # 312 bf16 and fp16 dense TFLOP/s, 2,039 GB/s HBM2e. Efficiency 0.52: Megatron-LM sustains
    # 52% of peak on A100s (Narayanan et al., SC21, arXiv 2104.04473). Latencies assumed.
    "dgx-a100": Cluster(
        name="dgx-a100", accelerator="A100-SXM4-80GB", nodes=1, per_node=8, memory=80e9, reserved=_RESERVED,
        flops={"fp64": 9.7e12, "fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
        mem_bandwidth=2039e9, intra=Link(300e9, 5e-6), inter=Link(200e9, 5e-6), efficiency=0.52, nics=8,
    ),
    # NVIDIA DGX H100 (DGX H100 datasheet): 8 x H100-SXM5-80GB on NVSwitch (NVLink 4: 900 GB/s per
    # GPU both ways, 450 each way), 8 x 400 Gbit/s NDR InfiniBand (ConnectX-7): 400 GB/s per node.
    # H100 SXM (NVIDIA H100 datasheet): 67 fp64 / 67 fp32 / 495 tf32 / 989 bf16 and fp16 dense
    # TFLOP/s, 3.35 TB/s HBM3. Efficiency 0.40: about 400 of 989 TFLOP/s per GPU in NVIDIA's
    # Megatron-LM benchmarks (up to 47% MFU). Latencies assumed.
    "dgx-h100": Cluster(
        name="dgx-h100", accelerator="H100-SXM5-80GB", nodes=1, per_node=8, memory=80e9, reserved=_RESERVED,
        flops={"fp64": 67e12, "fp32": 67e12, "tf32": 495e12, "bf16": 989e12, "fp16": 989e12},
        mem_bandwidth=3350e9, intra=Link(450e9, 5e-6), inter=Link(400e9, 5e-6), efficiency=0.40, nics=8,
    ),
}


# ---------------------------------------------------------------------------------------------
# placement: which node each rank of a d x w pipeline is on, and the links its cuts cross


def placement(cluster: Cluster, stages: int, width: int,
              layout: str = "replica") -> tuple[tuple[int, int, int, int], ...]:
    """``(rank, stage, replica, node)`` for every rank of a d x w pipeline, in rank order:
    ``layout`` (:func:`fxpipe.schedule.rank_of`, what the runtime then uses) on ``cluster``'s
    nodes (``rank // per_node``)."""
    rows = [(rank_of(s, r, stages, width, layout), s, r) for r in range(width) for s in range(stages)]
    return tuple((k, s, r, cluster.node_of(k)) for k, s, r in sorted(rows))


def stage_links(cluster: Cluster, stages: int, width: int,
                layout: str = "replica") -> tuple[tuple[float, float], ...]:
    """``(latency, bandwidth)`` between stage s and s + 1 for every s. Inside a node the intra
    link. Across nodes the inter-node link, shared: every stage pair of every replica sends at
    once in a pipeline's steady state, so a node's interface is divided among the flows leaving
    it (activations out of the sending node, gradients out of the receiving one), and a
    boundary runs at the pace of its most crowded replica (replicas run in lockstep); and one
    flow gets at most one of the node's ``nics`` interfaces. Ranks are placed by ``layout``
    (:func:`fxpipe.schedule.rank_of`)."""
    ranks = [[rank_of(s, r, stages, width, layout) for r in range(width)] for s in range(stages)]
    node = cluster.node_of
    crossing = [(s, r) for s in range(stages - 1) for r in range(width) if node(ranks[s][r]) != node(ranks[s + 1][r])]
    out: dict[int, int] = {}
    for s, r in crossing:  # activations leave the sender's node, gradients the receiver's
        out[node(ranks[s][r])] = out.get(node(ranks[s][r]), 0) + 1
        out[node(ranks[s + 1][r])] = out.get(node(ranks[s + 1][r]), 0) + 1
    share: dict[int, int] = {}
    for s, r in crossing:
        share[s] = max(share.get(s, 0), out[node(ranks[s][r])], out[node(ranks[s + 1][r])])
    intra = (cluster.intra.latency, cluster.intra.bandwidth)
    return tuple((cluster.inter.latency, cluster.inter.bandwidth / max(share[s], cluster.nics)) if s in share
                 else intra for s in range(stages - 1))


def crossing_stages(cluster: Cluster, stages: int, width: int, layout: str = "replica") -> list[int]:
    """The boundaries s (between stage s and s + 1) that some replica sends across nodes."""
    rank = lambda s, r: rank_of(s, r, stages, width, layout)  # noqa: E731
    return [s for s in range(stages - 1)
            if any(cluster.node_of(rank(s, r)) != cluster.node_of(rank(s + 1, r)) for r in range(width))]
