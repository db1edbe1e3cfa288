"""LoRA adapters served without merging: several adapters on one base model, chosen per request.

    llm = LLM("base", enable_lora=True, max_loras=4, max_lora_rank=16)
    llm.generate(prompts, params, lora=LoRARequest("sql", "adapters/sql"))

Each target projection of the model (q/k/v fused as qkv_proj, o_proj, gate/up fused as
gate_up_proj, down_proj) holds max_loras slots of factors; a token runs with its request's slot
(ops::lora_add: out += B (A x), gathered by slot, as punica / S-LoRA do), so requests for
different adapters and for none share one batch. An adapter is read (PEFT format, kvserve.lora)
when a request first names it, into a free slot or the least recently used one that no
unfinished request holds; its scaling goes into B. When every slot is held, the request waits
(checked, and counted among the engine's waiting requests) until one frees, first come first
served, while the requests behind it run, as in vLLM. So that a steady stream of requests for
the loaded adapters cannot hold every slot forever, one of them (the least recently used) then
drains: its new requests wait too, and its slot frees when its running ones end. The prefix
cache is keyed by adapter: a request reuses cached blocks only of requests of the same adapter.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.architectures import weight_names
from kvserve.loader.sharding import Shard, local_heads, local_intermediate
from kvserve.loader.weight_index import kvserve_name
from kvserve.lora import lora_scaling, read_adapter

# A checkpoint projection -> (the kvserve projection that holds it, its part of the fused output;
# None: the whole of it, for a checkpoint that stores the projection fused, as Phi-3 does).
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
         "qkv_proj": ("qkv_proj", None), "gate_up_proj": ("gate_up_proj", None)}


@dataclass(frozen=True, init=False)
class LoRARequest:
    """An adapter for a request: its name (one adapter per name) and its PEFT directory.

    LoRARequest(name, path), or vLLM's LoRARequest(lora_name, lora_int_id, lora_path) (its
    keywords too), so that vLLM scripts run unchanged: the integer id is checked and not used
    (kvserve keys adapters by name)."""
    name: str
    path: str | Path

    def __init__(self, name: str | None = None, *args, path: str | Path | None = None,
                 lora_name: str | None = None, lora_int_id: int | None = None,
                 lora_path: str | Path | None = None):
        if len(args) == 2:  # vLLM's positional (lora_name, lora_int_id, lora_path)
            lora_int_id, lora_path = args
        elif len(args) == 1:
            path = args[0]
        elif args:
            raise TypeError(f"LoRARequest takes (name, path) or (lora_name, lora_int_id, "
                            f"lora_path), got {len(args) + 1} positional arguments")
        if lora_int_id is not None and (isinstance(lora_int_id, bool) or
                                        not isinstance(lora_int_id, int) or lora_int_id < 1):
            raise ValueError(f"lora_int_id must be a positive integer, got {lora_int_id!r}")
        names = [v for v in (name, lora_name) if v is not None]
        paths = [v for v in (path, lora_path) if v is not None]
        if len(names) != 1 or len(paths) != 1:
            raise TypeError("LoRARequest needs one name (name or lora_name) and one path (path "
                            "or lora_path)")
        if not isinstance(names[0], str) or not names[0]:
            raise ValueError(f"a LoRA adapter needs a non-empty name, got {names[0]!r}")
        object.__setattr__(self, "name", names[0])
        object.__setattr__(self, "path", paths[0])


AdapterRef = LoRARequest


@dataclass
class _Loaded:
    path: Path
    slot: int
    key: int
    users: int = 0
    last_used: int = 0


class LoRAManager:
    """Which adapter is in which slot of an engine's model; thread-safe."""

    def __init__(self, engine, model, config, max_loras: int, max_lora_rank: int,
                 tensor_parallel_size: int = 1):
        self._engine = engine
        self._config = config  # kvserve's ModelConfig (head counts for the fused q/k/v split)
        self._ranks = tensor_parallel_size
        # Shapes of the whole model's projections: with several ranks, model (rank 0's) holds
        # its shard of each, and every rank gets its part of the whole adapter (_shard).
        self._targets = {name: (*self._whole(name, inp, out), rank)
                         for name, inp, out, rank in model.lora_targets()}
        self._dtype = model.dtype
        self._device = model.device
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self._slots: list[str | None] = [None] * max_loras
        self._loaded: dict[str, _Loaded] = {}
        self._clock = 0
        self._draining: str | None = None  # an adapter that takes no new users (drain)
        self._lock = threading.Lock()

    def drain(self) -> None:
        """A request waits for a slot: unless one already does, the least recently used loaded
        adapter takes no new users until its slot frees (a waiting request then gets it)."""
        with self._lock:
            if self._draining is None and self._loaded:
                self._draining = min(self._loaded, key=lambda n: self._loaded[n].last_used)

    def stop_draining(self) -> None:
        """No request waits for a slot any more."""
        with self._lock:
            self._draining = None

    def acquire(self, request: LoRARequest) -> tuple[int, int] | None:
        """(slot, prefix-cache key) of the adapter, loaded if it is not; one more user. None
        when every slot holds an adapter that unfinished requests use (the adapter checked all
        the same: try_acquire once one frees). Raises ValueError / TypeError for an adapter that
        does not fit the model (FileNotFoundError when it is missing)."""
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora must be a LoRARequest, got {type(request).__name__}")
        acquired = self.try_acquire(request)
        if acquired is None:
            with self._lock:
                checked = request.name in self._loaded  # (it loaded once: a draining one)
            if not checked:
                self.factors(Path(request.path))  # its errors now, not when a slot frees
        return acquired

    def try_acquire(self, request: LoRARequest) -> tuple[int, int] | None:
        """acquire without checking an adapter that finds no free slot (None: it reads nothing,
        so a waiting request can try each step)."""
        path = Path(request.path)
        with self._lock:
            self._clock += 1
            loaded = self._loaded.get(request.name)
            if loaded is not None and loaded.path.resolve() != path.resolve():
                raise ValueError(f"LoRA adapter '{request.name}' is loaded from {loaded.path}, "
                                 f"not {path}: one name, one adapter")
            if loaded is not None and request.name == self._draining:
                return None  # its slot is being freed for a waiting request
            if loaded is None:
                slot = self._free_slot()
                if slot is None:
                    return None
                loaded = self._load(request.name, path, slot)
            loaded.users += 1
            loaded.last_used = self._clock
            return loaded.slot, loaded.key

    def release(self, name: str) -> None:
        """One user fewer (its request finished)."""
        with self._lock:
            loaded = self._loaded.get(name)
            if loaded is not None and loaded.users > 0:
                loaded.users -= 1

    def loaded(self) -> dict[str, int]:
        """{adapter name: slot} of the adapters in the model now."""
        with self._lock:
            return {name: a.slot for name, a in self._loaded.items()}

    def _load(self, name: str, path: Path, slot: int) -> _Loaded:
        factors = self.factors(path)
        if self._ranks > 1:
            parts = [self._shard(factors, rank) for rank in range(self._ranks)]
            self._engine.set_lora(slot, parts[0], parts[1:])
        else:
            self._engine.set_lora(slot, factors)
        previous = self._slots[slot]
        if previous is not None:
            del self._loaded[previous]
            if previous == self._draining:  # drained: the next wait chooses another
                self._draining = None
        self._slots[slot] = name
        loaded = self._loaded[name] = _Loaded(path, slot, adapter_key(path))
        return loaded

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used one no unfinished request holds; None."""
        if None in self._slots:
            return self._slots.index(None)
        idle = [(self._loaded[n].last_used, self._loaded[n].slot) for n in self._slots
                if self._loaded[n].users == 0]
        return min(idle)[1] if idle else None

    def factors(self, path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{kvserve projection: (a [r, in], b [r, out])} of a PEFT adapter, its scaling in b and
        the parts of fused projections in their rows and columns."""
        config, modules, replacements = read_adapter(path)
        if replacements:
            raise ValueError(f"{path} replaces whole tensors ({', '.join(sorted(replacements))});"
                             " serve it merged (kvserve merge-lora)")
        if config.get("fan_in_fan_out"):
            raise ValueError(f"{path}: fan_in_fan_out adapters are not served; merge them")
        parts: dict[str, list[tuple[int | None, torch.Tensor, torch.Tensor]]] = {}
        for module, tensors in sorted(modules.items()):
            if "A" not in tensors:
                raise ValueError(f"{path}: {module} is an embedding; serve the adapter merged")
            # The checkpoint's module name as the loader names its weight (Bamba's
            # feed_forward is kvserve's mlp, Granite 4's shared_mlp.input_linear its gate_up_proj).
            weight = kvserve_name(f"{module}.weight", weight_names(self._config))
            base, _, leaf = weight.removesuffix(".weight").removeprefix("model.").rpartition(".")
            # A projection kvserve holds as named takes the whole of it (Nemotron-H's up_proj,
            # with no gate beside it); the others are parts of a fused one.
            target, part = ((leaf, None) if f"{base}.{leaf}" in self._targets
                            else FUSED.get(leaf, (leaf, 0)))
            name = f"{base}.{target}"
            if name not in self._targets:
                raise ValueError(f"{path}: {module} is not a projection kvserve serves LoRA on "
                                 f"(targets: q/k/v/o_proj, gate/up/down_proj of each layer)")
            a = tensors["A"].float()
            b = (tensors["B"].float() * lora_scaling(config, module)).t()  # [r, out part]
            if a.shape[0] > self.max_lora_rank:
                raise ValueError(f"{path}: {module} has rank {a.shape[0]}, above max_lora_rank "
                                 f"{self.max_lora_rank}")
            parts.setdefault(name, []).append((part, a, b))
        return {name: self._fuse(name, pieces) for name, pieces in parts.items()}

    def _fuse(self, name: str, pieces) -> tuple[torch.Tensor, torch.Tensor]:
        inp, out, _ = self._targets[name]
        widths = self._part_widths(name, out)
        offsets = [sum(widths[:i]) for i in range(len(widths))]
        rank = sum(a.shape[0] for _, a, _ in pieces)
        a_all = torch.zeros(rank, inp)
        b_all = torch.zeros(rank, out)
        row = 0
        for part, a, b in pieces:
            offset, width = (0, out) if part is None else (offsets[part], widths[part])
            if a.shape[1] != inp or b.shape[1] != width:
                which = "" if part is None else f" (part {part})"
                raise ValueError(f"the adapter's factors for {name}{which} are "
                                 f"{tuple(a.shape)} and {tuple(b.t().shape)}; the model's "
                                 f"projection is [{width}, {inp}]")
            r = a.shape[0]
            a_all[row:row + r] = a
            b_all[row:row + r, offset:offset + width] = b
            row += r
        return (a_all.to(self._dtype).to(self._device), b_all.to(self._dtype).to(self._device))

    def _whole(self, name: str, inp: int, out: int) -> tuple[int, int]:
        """(in, out) of the whole model's projection `name`, of which rank 0 holds [inp, out]."""
        if self._ranks == 1:
            return inp, out
        c = self._config
        q, kv, hidden = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size
        inter = c.intermediate_size
        whole = {"qkv_proj": (hidden, q + 2 * kv), "q_proj": (hidden, q), "o_proj": (q, hidden),
                 "gate_up_proj": (hidden, 2 * inter), "down_proj": (inter, hidden)}
        kind = name.rpartition(".")[2]
        if kind not in whole or c.use_mla():
            raise ValueError(f"LoRA on {name} is not served with tensor parallelism")
        return whole[kind]

    def _shard(self, factors: dict, rank: int) -> dict:
        """Rank `rank`'s part of whole factors (kvserve.loader.sharding's split): B's columns
        of a column-parallel projection (the rank's heads, or its intermediate columns of gate
        and of up), A's columns of a row-parallel one, whose partial updates the ranks sum."""
        c, shard = self._config, Shard(rank, self._ranks)
        q0, nq, kv0, nkv = (n * c.head_dim for n in local_heads(c, shard))
        first, n = local_intermediate(c, shard)
        q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        out = {}
        for name, (a, b) in factors.items():
            kind = name.rpartition(".")[2]
            if kind == "qkv_proj":
                b = torch.cat([b[:, q0:q0 + nq], b[:, q + kv0:q + kv0 + nkv],
                               b[:, q + kv + kv0:q + kv + kv0 + nkv]], dim=1)
            elif kind == "q_proj":
                b = b[:, q0:q0 + nq]
            elif kind == "o_proj":
                a = a[:, q0:q0 + nq]
            elif kind == "gate_up_proj":
                b = torch.cat([b[:, first:first + n], b[:, inter + first:inter + first + n]], dim=1)
            else:  # down_proj
                a = a[:, first:first + n]
            out[name] = (a.contiguous(), b.contiguous())
        return out

    def _part_widths(self, name: str, out: int) -> list[int]:
        """Output widths of the checkpoint projections fused into `name`."""
        c = self._config
        if name.endswith("qkv_proj"):
            q = c.num_heads * c.head_dim
            kv = c.num_kv_heads * c.head_dim
            return [q, kv, kv]
        if name.endswith("gate_up_proj"):
            return [out // 2, out // 2]
        return [out]


def adapter_key(path: Path) -> int:
    """A prefix-cache key for an adapter's files (their path, size and modification time): the
    same adapter loaded again keeps its cached blocks; another never shares them. Never 0 (the
    base model's key)."""
    h = hashlib.blake2b(digest_size=8)
    for file in (path / "adapter_config.json", path / "adapter_model.safetensors"):
        st = file.stat()
        h.update(f"{file.resolve()}:{st.st_size}:{st.st_mtime_ns};".encode())
    return int.from_bytes(h.digest(), "little") or 1
