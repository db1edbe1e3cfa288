"""``LLMEngine``: text in, text out, over the C++ ContinuousBatchingEngine.

    engine = LLMEngine("models/shakespeare-target")
    engine.add_request("a", "ROMEO:", SamplingParams(max_tokens=32, stop=["\\n\\n"]))
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.outputs[0].delta_text, end="", flush=True)

The C++ engine schedules, runs the model and samples token ids; this layer tokenizes prompts,
detokenizes outputs incrementally (text deltas for streaming) and matches stop strings in the text,
also across token boundaries.

Threads: add_request, abort_request, has_unfinished_requests and get_stats may be called from any
thread while one thread steps (kvserve.AsyncLLMEngine is that shape); two step() calls at once
run one after the other.
"""

from __future__ import annotations

import copy
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvserve import _C
from kvserve.architectures import ARCHITECTURES
from kvserve.config import (load_checkpoint_info, resolve_dtype, resolve_kv_cache_dtype,
                            set_quantized_activation)
from kvserve.engine_args import EngineArgs
from kvserve.kv_transfer.params import KVTransferParams
from kvserve.loader import load_embedding, load_weights
from kvserve.lora_serving import LoRAManager, LoRARequest
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams, generation_defaults
from kvserve.loader.eagle3_weights import eagle3_config, eagle3_head, load_eagle3_weights
from kvserve.loader.mtp_weights import load_mtp_weights, mtp_configs, mtp_head
from kvserve.speculative import load_draft_info, quantize_drafter
from kvserve.tensor_parallel import TensorParallelRanks, load_rank_mtp_head, load_rank_model
from kvserve.tokenizer import IncrementalDetokenizer, Tokenizer



@dataclass
class _Sample:
    """The text side of one completion."""

    detokenizer: IncrementalDetokenizer | None
    emitted: int = 0           # characters of the text already returned as deltas
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # one per token id, when the request asks
    finish_reason: str | None = None
    detokenized: int = 0       # token_ids already given to the detokenizer


@dataclass
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    # params.stop, read once: every read of the C++ field copies its strings.
    stop: tuple[str, ...] = ()
    delta: bool = False  # output_kind "delta": outputs carry only what is new
    samples: dict[int, _Sample] = field(default_factory=dict)
    final_metrics: object = None  # set when stop strings finished it (the engine forgot it)
    lora: str | None = None  # the adapter's name (LoRAManager), released when it finishes
    prompt_logprobs: list | None = None  # [None, entries...] once the engine reported them
    holds_kv: bool = False  # a producer's: its KV stays held for a consumer when it finishes

    @property
    def stop_holdback(self) -> int:
        """Characters of a running sample's text held back: they could start a stop string."""
        if not self.stop or self.params.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1


OUTPUT_KINDS = ("cumulative", "delta")


def check_device(device: str | torch.device) -> torch.device:
    """The device to run on: the CPU, or a CUDA GPU when torch sees one and this build holds
    the CUDA kernels; ValueError otherwise."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}") from e
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {str(device)!r}")
    if not _C.built_with_cuda():
        raise ValueError("device 'cuda': this kvserve build has no CUDA kernels (build it with a "
                         "CUDA torch and nvcc installed)")
    if not torch.cuda.is_available():
        raise ValueError("device 'cuda': torch sees no CUDA GPU")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r}: there are {torch.cuda.device_count()} GPUs")
    return torch.device("cuda", index)


def _release_freed_memory() -> None:
    """Returns the heap that loading freed (plain weights replaced by packed ones, conversion
    buffers) to the OS, so the process's resident memory is the model's. glibc only; a no-op
    elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def blocks_per_sequence(layout, length: int, block_size: int, max_chunk: int) -> int:
    """Block ids a sequence of `length` tokens (all of them prompt, prefilled in chunks of at
    most max_chunk tokens) holds at most in a pool of this layout (PagedBlockManager's bound)."""
    return _C.PagedBlockManager.max_blocks_held_for(layout.group_windows(), block_size, length,
                                                    length, max_chunk)


class LLMEngine:
    """A model loaded for serving: add requests at any time, call step() to advance all of them.

    LLMEngine(model, **options) takes the options of kvserve.EngineArgs (their types, defaults
    and meaning are listed there, and in `python -m kvserve serve --help`);
    LLMEngine.from_engine_args(args) takes an EngineArgs. Raises ValueError naming a bad option,
    FileNotFoundError for a checkpoint that is not there.
    """

    def __init__(self, model: str | Path, **options):
        self._build(EngineArgs(model, **options))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        engine = cls.__new__(cls)
        engine._build(args)
        return engine

    def _build(self, args: EngineArgs) -> None:
        self.args = args
        device = check_device(args.device)
        info = load_checkpoint_info(args.model)
        set_quantized_activation(info.config, args.quantized_activation, device)
        self.model_dir = Path(args.model)
        self.config = info.config
        self.hf_config = info.hf_config
        self.dtype = resolve_dtype(args.dtype, info.checkpoint_dtype)
        self.kv_cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        self.eos_token_ids = info.eos_token_ids
        self.tokenizer = Tokenizer.from_model_dir(args.model)
        # What a request's unset sampling fields default to (LLM.generate without parameters,
        # the server's requests).
        self.default_sampling = generation_defaults(args.generation_config, args.model)
        eagle3 = args.speculative_method == "eagle3"
        draft_info = (load_draft_info(args.speculative_model, info.config, self.tokenizer)
                      if args.speculative_model is not None and not eagle3 else None)
        if draft_info is not None:
            set_quantized_activation(draft_info.config, args.quantized_activation, device)
        self.draft_config = draft_info.config if draft_info is not None else None
        mtp = args.speculative_method == "mtp"
        if mtp:  # the checkpoint's own multi-token-prediction modules draft
            self.draft_config = mtp_configs(self.model_dir, info.hf_config, info.config)[1]
        if eagle3 and args.speculative_model is not None:  # an EAGLE-3 head on the target
            self.draft_config = eagle3_config(args.speculative_model, info.config)[0]
        # Every option checked (C++) before the weights load.
        config = args.engine_config(info.config, self.dtype, self.kv_cache_dtype,
                                    info.eos_token_ids, self.draft_config)
        self.max_model_len = config.max_model_len
        if info.config.num_ssm_layers() > 0 and args.kv_role is not None and args.async_scheduling:
            # A step launched ahead would run a held request's sampled token through its state.
            raise ValueError("kv_role with async_scheduling is not supported for models with "
                             f"state-space layers ({info.config.architecture})")
        if args.enable_lora:
            if ARCHITECTURES[info.config.architecture].fold_weights is not None:
                raise ValueError(f"LoRA adapters are not supported for "
                                 f"{info.config.architecture} yet: its multipliers are folded "
                                 "into the projections an adapter would add to")
            for name in ("max_loras", "max_lora_rank"):
                if getattr(args, name) < 1:
                    raise ValueError(f"{name} must be a positive integer, got "
                                     f"{getattr(args, name)!r}")
        self.ranks = None
        self._check_tensor_parallel(args)
        if args.tensor_parallel_size > 1:
            self.ranks = TensorParallelRanks(args)
            try:
                rank_model = load_rank_model(args, self.ranks.groups, info.eos_token_ids,
                                             self.draft_config)
            except BaseException:
                self.ranks.close(timeout_s=0.0)  # the workers stop with the groups
                raise
            self.model, config = rank_model.model, rank_model.engine_config
            self.rank_model = rank_model
        else:
            weights = load_weights(self.model_dir, info.config, self.dtype, device)
            self.model = _C.create_causal_lm(info.config, weights, self.max_model_len)
            del weights  # the model packed or copied what it keeps
        if args.enable_lora:
            self.model.enable_lora(args.max_loras, args.max_lora_rank)
        self.draft_model = None
        if draft_info is not None:  # in the target's dtype
            weights = load_weights(Path(args.speculative_model), draft_info.config, self.dtype,
                                   device)
            if args.speculative_quantization is not None:
                quantize_drafter(weights, draft_info.config, args.speculative_quantization,
                                 args.speculative_model)
                set_quantized_activation(draft_info.config, args.quantized_activation, device)
            self.draft_model = _C.create_causal_lm(draft_info.config, weights,
                                                   self.max_model_len)
            del weights
        if eagle3 and args.speculative_model is not None:
            head = load_eagle3_weights(args.speculative_model, info.config, self.dtype, device)
            if self.ranks is not None and "embed_tokens.weight" not in head.weights:
                # The head runs on rank 0 alone, and rank 0's embedding holds its rows only.
                head.weights["embed_tokens.weight"] = load_embedding(
                    self.model_dir, info.config, self.dtype, device)
            if args.speculative_quantization is not None:
                quantize_drafter(head.weights, head.config, args.speculative_quantization,
                                 args.speculative_model)
                set_quantized_activation(head.config, args.quantized_activation, device)
            self.draft_model = eagle3_head(head, self.model, self.max_model_len)
        if mtp and self.ranks is not None:  # split as the target is, run on every rank
            self.draft_model = load_rank_mtp_head(args, self.ranks.groups, info, self.model,
                                                  self.max_model_len)
        elif mtp:
            self.draft_model = mtp_head(
                load_mtp_weights(self.model_dir, info.hf_config, info.config, self.dtype, device),
                self.model, self.max_model_len)
        _release_freed_memory()
        self.engine = _C.ContinuousBatchingEngine(
            self.model, config, self.draft_model,
            self.ranks.groups.control_communicator() if self.ranks else None)
        self.lora_manager = (LoRAManager(self.engine, self.model, info.config, args.max_loras,
                                         args.max_lora_rank, args.tensor_parallel_size)
                             if args.enable_lora else None)
        self.kv_connector = None
        if args.kv_role is not None:
            if self.ranks is not None:
                raise ValueError("kv_role with tensor_parallel_size > 1 is not supported yet: "
                                 "a transfer moves one rank's pool")
            from kvserve.kv_transfer import TorchDistributedConnector

            self.kv_connector = TorchDistributedConnector(
                self.engine, args.kv_role, args.kv_host, args.kv_port, args.kv_transfer_timeout)
        self._requests: dict[str, _Request] = {}  # under _lock
        self._bad_words_cache: dict[tuple[str, ...], list[list[int]]] = {}
        # Requests whose adapter waits for a free LoRA slot, first come first served (under
        # _lock): the C++ engine holds them as waiting (Scheduler::kLoraPending).
        self._lora_waiting: dict[str, LoRARequest] = {}
        self._lock = threading.Lock()
        self._step_lock = threading.Lock()
        if args.log_memory_plan:
            print(self.memory_plan(), file=sys.stderr)
            if self.default_sampling:
                print(self.default_sampling_note(), file=sys.stderr)

    def default_sampling_note(self) -> str:
        """One line for a start-up log: the defaults generation_config.json gives, if any."""
        if not self.default_sampling:
            return "default sampling parameters: SamplingParams' own"
        given = ", ".join(f"{k}={v}" for k, v in self.default_sampling.items())
        return (f"default sampling parameters from generation_config.json: {given} "
                "(generation_config none: SamplingParams' own)")

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the defaults of generation_config (the checkpoint's
        generation_config.json unless the engine was made with another or none)."""
        return SamplingParams(**self.default_sampling)

    @staticmethod
    def _check_tensor_parallel(args: EngineArgs) -> None:
        if not isinstance(args.tensor_parallel_size, int) or args.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got "
                             f"{args.tensor_parallel_size!r}")
        if not args.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be > 0 seconds, got "
                             f"{args.distributed_timeout!r}")
        if args.tensor_parallel_size == 1:
            return
        if args.distributed_backend == "nccl":
            raise ValueError("the ranks share this machine's device; nccl needs one GPU per "
                             "rank, which is not built yet: use distributed_backend='gloo'")

    def shutdown(self) -> None:
        """Stops the KV connector and the tensor-parallel ranks this engine started (a no-op for
        one rank without a connector); the engine cannot step afterwards."""
        if self.kv_connector is not None:
            self.kv_connector.close()
        if self.ranks is None:
            return
        self.engine = None  # its runner tells the workers to stop
        self.lora_manager = None
        self.ranks.close()

    def memory_plan(self) -> str:
        kv = self.engine.kv_cache
        full_len = self.max_model_len
        per_sequence = self.engine.block_manager.max_blocks_held(
            full_len, full_len, self.engine.config.max_num_batched_tokens)
        concurrent = (kv.num_blocks - 1) // per_sequence
        plan = f"kvserve: weights {self.model.weight_bytes / 2**20:.1f} MiB ({self.dtype}); "
        running = self.engine.block_manager.num_state_slots()  # a state slot each
        snapshots = self.engine.block_manager.num_state_snapshots()
        if kv.layout.num_layers == 0:  # every layer keeps a state (Mamba2): blocks count tokens
            plan += (f"no KV cache (no attention layers); {running} sequences of "
                     f"max_model_len {full_len} fit at once")
        else:
            kv_bytes = kv.nbytes - kv.num_state_slots * kv.state_bytes_per_sequence
            plan += (f"KV cache {kv_bytes / 2**20:.1f} MiB = {kv.num_blocks - 1} blocks x "
                     f"{kv.block_size} tokens = {kv.capacity_tokens:,} tokens at "
                     f"{kv.bytes_per_token:,} bytes/token; "
                     f"{min(concurrent, running or concurrent)} sequences of "
                     f"max_model_len {full_len} fit at once")
        if self.kv_cache_dtype != self.dtype:
            plain = kv.layout.bytes_per_slot_token(self.dtype)
            plan += (f" ({str(self.kv_cache_dtype).removeprefix('torch.')} entries with a fp32 "
                     f"scale per token and head: {self.dtype} would take {plain:,} bytes/token, "
                     f"{plain / kv.bytes_per_token:.1f}x more)")
        if kv.layout.latent:
            plain = _C.KVCacheLayout.multi_head_equivalent(self.config).bytes_per_token(self.dtype)
            plan += (f" (MLA latents: plain multi-head K/V would take {plain:,} bytes/token, "
                     f"{plain / kv.bytes_per_token:.1f}x more)")
        if kv.layout.has_state():
            state = kv.layout.state
            ssm = self.engine.config.ssm_state_dtype or torch.float32
            plan += (f"; states {kv.num_state_slots * kv.state_bytes_per_sequence / 2**20:.1f} "
                     f"MiB = {kv.num_state_slots} slots x {kv.state_bytes_per_sequence:,} "
                     f"bytes/sequence, whatever its length ({len(state.layers)} state-space "
                     f"layers: conv [{state.conv_dim}, {state.conv_kernel - 1}] in "
                     f"{str(self.dtype).removeprefix('torch.')}, "
                     f"SSM [{state.num_heads}, {state.head_dim}, {state.state_size}] in "
                     f"{str(ssm).removeprefix('torch.')})")
            plan += (f"; prefix caching on: {snapshots} of the slots keep states saved at block "
                     "boundaries" if snapshots else
                     "; prefix caching off (num_state_snapshots saves states for it)")
            if self.engine.config.speculative.enabled:
                plan += (f"; {self.engine.config.max_num_seqs} of the slots back up states "
                         "before steps that verify drafts")
        if kv.layout.groups:
            local = [g for g in kv.layout.groups if g.sliding_window]
            kinds = (f"{len(kv.layout.groups) - len(local)} global, {len(local)} local (window "
                     f"{', '.join(sorted({str(g.sliding_window) for g in local}))})")
            held = per_sequence * kv.layout.num_slots()
            plain = -(-full_len // kv.block_size) * kv.layout.num_layers
            plan += (f" (layer groups of {kv.layout.num_slots()}: {kinds}; a sequence of "
                     f"max_model_len holds {held} layer-blocks instead of {plain}, "
                     f"{plain / held:.1f}x fewer)")
        attention_layers = sum(map(self.config.has_attention, range(self.config.num_layers)))
        if not kv.layout.latent and 0 < self.config.num_kv_layers() < attention_layers:
            plain = _C.KVCacheLayout.multi_head_equivalent(self.config).bytes_per_token(self.dtype)
            shared = _C.KVCacheLayout.for_model(self.config).bytes_per_token(self.dtype)
            plan += (f" (KV sharing: {self.config.num_kv_layers()} of {self.config.num_layers} "
                     f"layers cache K/V; without sharing {plain:,} bytes/token, "
                     f"{plain / shared:.1f}x more)")
        if self.ranks is not None:
            r, size = self.rank_model, self.ranks.groups.world_size
            local_kv, kv_heads = r.config.num_kv_heads, self.config.num_kv_heads
            copies = local_kv * size // kv_heads
            heads = ("KV: the latent, replicated on every rank" if kv.layout.latent else
                     f"KV {local_kv} of {kv_heads} KV heads a layer"
                     + (f" (each held by {copies} ranks)" if copies > 1 else ""))
            if r.config.num_ssm_layers() > 0:
                unit = "channels" if r.config.ssm.kind == "mamba" else "heads"
                states = (f"states of {r.config.ssm.num_heads} of "
                          f"{self.config.ssm.num_heads} state-space {unit} a layer")
                heads = states if kv.layout.num_layers == 0 else f"{heads}; {states}"
            plan += (f"; tensor parallel, rank 0 of {size} (each rank the same): weights "
                     f"{r.split_bytes / 2**20:.1f} MiB split (1/{size} of every projection"
                     + (" and mixer" if r.config.num_ssm_layers() > 0 else "")
                     + ", of the embedding and of the LM head) + "
                     f"{r.replicated_bytes / 2**20:.1f} MiB replicated (norms, routers"
                     + (", latent projections" if kv.layout.latent else "") + f"); {heads}"
                     + (f", {kv.nbytes / kv.num_blocks / 2**10:.1f} KiB a block on each rank, "
                        f"{kv.num_blocks - 1} blocks agreed" if kv.layout.num_layers else ""))
        spec = self.engine.config.speculative
        if self.draft_model is not None:
            c = self.draft_model.config  # a rank's part of MTP modules split over the ranks
            draft_kv = (kv.num_blocks * _C.PagedKVCache.bytes_per_block(
                _C.KVCacheLayout.for_model(c), kv.block_size, self.dtype))
            what = {"mtp": "MTP modules", "eagle3": "EAGLE-3 head"}.get(spec.method,
                                                                        "draft model")
            where = ""
            if self.ranks is not None:
                where = (" on each rank, split as the target" if spec.method == "mtp"
                         else " on rank 0 alone")
            plan += (f"; {what} {self.draft_model.weight_bytes / 2**20:.1f} MiB + KV "
                     f"{draft_kv / 2**20:.1f} MiB{where}, {spec.num_speculative_tokens} tokens "
                     "per step")
        elif spec.enabled:
            plan += (f"; n-gram speculation, {spec.num_speculative_tokens} tokens per step "
                     f"(suffixes of {spec.prompt_lookup_min}-{spec.prompt_lookup_max} tokens)")
        return plan

    # ------------------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    priority: int = 0, lora: LoRARequest | None = None,
                    output_kind: str = "cumulative",
                    kv_transfer_params: dict | KVTransferParams | None = None) -> None:
        """Queues a prompt (text, or token ids), with a LoRA adapter if given (an engine made
        with enable_lora); params None: get_default_sampling_params(). output_kind
        "cumulative": each output's text, token_ids and logprobs are everything so far;
        "delta": only what the step added (a server streaming a long output copies nothing per
        step). kv_transfer_params (an engine with a kv_role):
        do_remote_decode holds the prompt's KV for a consumer when the request finishes (its
        final output's kv_transfer_params say where); do_remote_prefill pulls it from the
        producer they name instead of computing it. Raises ValueError / TypeError for bad input, and
        kvserve.EngineOverloadedError when max_waiting_requests requests already wait; the
        engine keeps serving the other requests."""
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {output_kind!r}")
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request id '{request_id}' is already in use")
        params = self.get_default_sampling_params() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self._tokenize(prompt)
        if params.bad_words and not params.bad_words_token_ids:
            params = copy.copy(params)  # the caller's object (often shared by prompts) unchanged
            params.bad_words_token_ids = self._bad_words_token_ids(tuple(params.bad_words))
        kept = self.truncate_prompt(ids, params.truncate_prompt_tokens)
        if len(kept) < len(ids):  # the output's prompt text is what was kept
            ids = kept
            text = self.tokenizer.decode(ids) if text is not None else None
        kv = self._kv_transfer(KVTransferParams.from_dict(kv_transfer_params), params)
        slot, key = -1, 0
        held = None  # the adapter whose slot this request holds
        if lora is not None:
            if self.lora_manager is None:
                raise ValueError("a LoRA adapter needs an engine made with enable_lora=True")
            acquired = self.lora_manager.acquire(lora)
            if acquired is None:  # every slot is held: it waits for one (_assign_waiting_loras)
                slot = _C.LORA_PENDING
            else:
                (slot, key), held = acquired, lora.name
        # Registered first: once the C++ engine has it, a step on another thread may report it.
        with self._lock:
            if request_id in self._requests:
                if held is not None:
                    self.lora_manager.release(held)
                raise ValueError(f"request id '{request_id}' is already in use")
            self._requests[request_id] = _Request(
                text, ids, params, tuple(params.stop), output_kind == "delta", lora=held,
                holds_kv=kv[0] == _C.KVTransfer.HOLD)
        try:
            if kv[0] == _C.KVTransfer.LOAD:
                self.kv_connector.register_load(request_id, kv[1], ids)
            self.engine.add_request(request_id, ids, params, arrival_time, priority,
                                    lora_slot=slot, lora_key=key, kv_transfer=kv[0])
        except BaseException:
            if kv[0] == _C.KVTransfer.LOAD:
                self.kv_connector.forget_load(request_id)
            with self._lock:
                del self._requests[request_id]
            if held is not None:
                self.lora_manager.release(held)
            raise
        if slot == _C.LORA_PENDING:
            with self._lock:
                if request_id in self._requests:  # (not already aborted and reported)
                    self._lora_waiting[request_id] = lora
            self.lora_manager.drain()

    def _kv_transfer(self, kv: KVTransferParams | None, params: SamplingParams):
        """(_C.KVTransfer, params) of a request's kv_transfer_params; ValueError when this
        engine cannot take its part."""
        if kv is None or not (kv.do_remote_decode or kv.do_remote_prefill):
            return _C.KVTransfer.NONE, kv
        if self.kv_connector is None:
            raise ValueError("kv_transfer_params asks for a KV transfer, and this engine has no "
                             "kv_role")
        self.kv_connector.check_request(kv, params)
        return (_C.KVTransfer.HOLD if kv.do_remote_decode else _C.KVTransfer.LOAD), kv

    def truncate_prompt(self, ids: list[int], keep: int | None) -> list[int]:
        """The prompt's last `keep` tokens (truncate_prompt_tokens: -1 is max_model_len), as
        vLLM keeps them; the whole prompt when it is None. A truncated text prompt is reported
        as the text of the tokens kept (RequestOutput.prompt). ValueError for any other count
        (SamplingParams' own check, for a caller that truncates before it builds them)."""
        if keep is None:
            return ids
        if keep == 0 or keep < -1:
            raise ValueError("truncate_prompt_tokens must be -1 (max_model_len) or >= 1, "
                             f"got {keep}")
        keep = self.max_model_len if keep == -1 else keep
        return ids[-keep:] if len(ids) > keep else ids

    def _bad_words_token_ids(self, words: tuple[str, ...]) -> list[list[int]]:
        """The token sequences that spell `words` in an output, as vLLM finds them: each word
        (leading whitespace dropped) on its own, and also after a space when that spells it with
        another first token in as many tokens (a word inside a sentence). Remembered for the
        last 64 word lists (one SamplingParams often serves many prompts)."""
        if self.tokenizer is None:
            raise ValueError(f"bad_words need a tokenizer and {self.model_dir} has no "
                             "tokenizer.json")
        cache = self._bad_words_cache
        if words not in cache:
            sequences = []
            for word in words:
                alone = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
                spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
                sequences += [alone] if alone else []
                if alone and len(spaced) == len(alone) and spaced[0] != alone[0]:
                    sequences.append(spaced)
            if len(cache) >= 64:
                cache.clear()
            cache[words] = sequences
        return cache[words]

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir} has no tokenizer.json; pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.config.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:  # before the C++ conversion, which rejects ints beyond int64
                raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
            return None, list(prompt)
        raise TypeError(f"a prompt must be a string or a list of ints, got {prompt!r:.80}")

    def abort_request(self, request_id: str) -> bool:
        """Stops a request; its final output (finish_reason "abort") comes with the next step."""
        return self.engine.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def get_stats(self):
        return self.engine.get_stats()

    @property
    def scheduler(self):
        return self.engine.scheduler

    @property
    def block_manager(self):
        return self.engine.block_manager

    @property
    def kv_cache(self):
        return self.engine.kv_cache

    # ------------------------------------------------------------------------------ step
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One engine iteration: the requests that produced text or finished in it.

        With finished_only (what LLM.generate uses), only the requests that finished are returned,
        and a running request's text is not built step by step unless it has stop strings to
        match: its tokens are detokenized when it finishes, into the same text."""
        with self._step_lock:
            return self._step(finished_only)

    def _step(self, finished_only: bool) -> list[RequestOutput]:
        outputs = []
        if self.ranks is not None:
            # A spawned rank that has exited fails the step now: its collectives would otherwise
            # fail only when Gloo notices the closed connection, which under load has taken the
            # whole distributed_timeout.
            self.ranks.check_alive()
        # finished_only: the C++ engine reports only finished requests and those with stop strings;
        # the others' tokens arrive at once in their final output.
        raws = self.engine.step(finished_only)
        if self.kv_connector is not None:  # blocks allocated this step: their pulls start
            for load in self.engine.take_kv_loads():
                self.kv_connector.start_load(load)
        for raw in raws:
            with self._lock:
                request = self._requests.get(raw.request_id)
            if request is None:  # a stop string finished it before this abort's output came
                continue
            try:
                out = self._output(raw, request, finished_only)
            except Exception as error:  # one bad output never discards the step's others
                out = self._fail(raw.request_id, request, error)
            if out is not None:
                outputs.append(out)
        if self._lora_waiting:  # slots this step's finished requests gave back
            outputs += self._assign_waiting_loras()
        return outputs

    def _assign_waiting_loras(self) -> list[RequestOutput]:
        """Loads the adapters of waiting requests into the slots free now, first come first
        served, and hands each its slot; an adapter that fails to load now ends its request
        with an error (its output returned)."""
        failed = []
        with self._lock:
            waiting = list(self._lora_waiting.items())
        for request_id, lora in waiting:
            try:
                acquired = self.lora_manager.try_acquire(lora)
            except Exception as error:  # e.g. its directory removed since it was checked
                with self._lock:
                    self._lora_waiting.pop(request_id, None)
                    request = self._requests.get(request_id)
                if request is not None:
                    failed.append(self._fail(request_id, request, error,
                                             f"LoRA adapter '{lora.name}' failed to load"))
                continue
            if acquired is None:
                continue  # no free slot (a later request's adapter may be loaded already)
            with self._lock:
                self._lora_waiting.pop(request_id, None)
                request = self._requests.get(request_id)
                if request is not None:
                    request.lora = lora.name  # released when it finishes (_forget)
            if request is None or not self.engine.assign_lora(request_id, *acquired):
                if request is not None:
                    with self._lock:
                        request.lora = None
                self.lora_manager.release(lora.name)
        with self._lock:
            still_waiting = bool(self._lora_waiting)
        if still_waiting:
            self.lora_manager.drain()  # (another adapter, once the drained one was replaced)
        else:
            self.lora_manager.stop_draining()
        return failed

    def _output(self, raw, request: _Request, finished_only: bool) -> RequestOutput | None:
        """The RequestOutput of one request's raw step output (None: nothing to report yet)."""
        prompt_logprobs = self._prompt_logprobs(raw, request)
        if finished_only:
            for o in raw.outputs:
                self._record_tokens(raw.request_id, request, o)
            if len(raw.outputs) < request.params.n or any(
                    self._sample(request, o.index).finish_reason is None for o in raw.outputs):
                return None
        completions = [self._update_sample(raw.request_id, request, o, recorded=finished_only)
                       for o in raw.outputs]
        finished = all(c.finished for c in completions) and len(completions) == request.params.n
        metrics = request.final_metrics if request.final_metrics is not None else raw.metrics
        out = RequestOutput(raw.request_id, request.prompt, request.prompt_token_ids,
                            completions, finished, metrics, raw.num_cached_tokens, raw.error,
                            prompt_logprobs)
        if finished:
            if request.holds_kv:
                sample = self._sample(request, 0)
                out.kv_transfer_params = self.kv_connector.request_finished(
                    raw.request_id, request.prompt_token_ids, sample.token_ids, sample.logprobs)
            self._forget(raw.request_id, request)
        return out

    @staticmethod
    def _prompt_logprobs(raw, request: _Request) -> list | None:
        """The prompt logprobs an output carries: every output's from the one that brings
        them ("delta": that one only)."""
        if request.params.prompt_logprobs is None:
            return None
        arrived = request.prompt_logprobs is None and (
            raw.prompt_logprobs or len(request.prompt_token_ids) == 1)
        if arrived:
            request.prompt_logprobs = [None, *raw.prompt_logprobs]
        return request.prompt_logprobs if arrived or not request.delta else None

    def _fail(self, request_id: str, request: _Request, error: Exception,
              what: str = "building this request's output failed") -> RequestOutput:
        """Ends a request whose output could not be built (or whose adapter could not be loaded)
        with finish_reason "error" (the engine aborts it; that abort's output, when it comes,
        finds the request gone)."""
        self.engine.abort_request(request_id)
        completions = []
        for index in range(request.params.n):
            sample = self._sample(request, index)
            sample.finish_reason = "error"
            completions.append(CompletionOutput(index, "", [], "error"))
        self._forget(request_id, request)
        return RequestOutput(request_id, request.prompt, request.prompt_token_ids, completions,
                             True, request.final_metrics, 0,
                             f"{what}: {type(error).__name__}: {error}")

    def _forget(self, request_id: str, request: _Request) -> None:
        with self._lock:
            self._requests.pop(request_id, None)
            self._lora_waiting.pop(request_id, None)
        if self.kv_connector is not None and self.kv_connector.role != "producer":
            self.kv_connector.forget_load(request_id)
        if request.lora is not None:
            self.lora_manager.release(request.lora)

    def _sample(self, request: _Request, index: int) -> _Sample:
        sample = request.samples.get(index)
        if sample is None:
            detok = (IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids)
                     if self.tokenizer is not None else None)
            sample = request.samples[index] = _Sample(detok)
        return sample

    def _record_tokens(self, request_id: str, request: _Request, raw) -> None:
        """Takes a step's new tokens of one completion; detokenizes them now only when stop
        strings must be matched (finished_only steps)."""
        sample = self._sample(request, raw.index)
        if sample.finish_reason is not None:
            return
        sample.token_ids.extend(raw.new_token_ids)
        sample.logprobs.extend(raw.new_logprobs)
        sample.finish_reason = raw.finish_reason
        if request.stop:
            self._detokenize(request_id, request, sample, raw.index)

    def _detokenize(self, request_id: str, request: _Request, sample: _Sample, index: int,
                    deferred: bool = False) -> None:
        """Feeds the detokenizer the tokens it has not seen: a step's worth, or all of a
        completion's at once when they were deferred (finished_only)."""
        if sample.detokenizer is None or sample.detokenized == len(sample.token_ids):
            return
        new_ids = sample.token_ids[sample.detokenized:]
        sample.detokenized = len(sample.token_ids)
        if deferred:
            sample.detokenizer.add_all(new_ids)
        else:
            sample.detokenizer.add(new_ids)
        if sample.finish_reason is not None:  # the engine ended it: nothing more to wait for
            step_delta = sample.detokenizer.last_delta
            sample.detokenizer.last_delta = step_delta + sample.detokenizer.flush()
        self._match_stop_strings(request_id, request, sample, index)

    def _update_sample(self, request_id: str, request: _Request, raw,
                       recorded: bool = False) -> CompletionOutput:
        sample = self._sample(request, raw.index)
        new_ids = list(raw.new_token_ids)
        if not recorded and sample.finish_reason is None:
            sample.token_ids.extend(new_ids)
            sample.logprobs.extend(raw.new_logprobs)
            sample.finish_reason = raw.finish_reason
        self._detokenize(request_id, request, sample, raw.index, deferred=recorded)
        text = sample.detokenizer.text if sample.detokenizer is not None else ""
        # While running, hold back what could be the start of a stop string.
        visible = len(text) if sample.finish_reason else max(
            sample.emitted, len(text) - request.stop_holdback)
        delta = text[sample.emitted:visible]
        sample.emitted = visible
        want_logprobs = request.params.logprobs is not None
        if request.delta:
            logprobs = (sample.logprobs[len(sample.token_ids) - len(new_ids):len(sample.token_ids)]
                        if want_logprobs else None)
            return CompletionOutput(raw.index, delta, new_ids, sample.finish_reason, delta,
                                    new_ids, logprobs)
        logprobs = sample.logprobs[:len(sample.token_ids)] if want_logprobs else None
        return CompletionOutput(raw.index, text[:visible] if not sample.finish_reason else text,
                                list(sample.token_ids), sample.finish_reason, delta, new_ids,
                                logprobs)

    def _match_stop_strings(self, request_id, request: _Request, sample: _Sample,
                            index: int) -> None:
        """Ends the sample at the first stop string in its text (searching only where new text
        could complete one); the stop string is cut unless include_stop_str_in_output."""
        params = request.params
        if not request.stop:
            return
        detok = sample.detokenizer
        longest = max(len(s) for s in request.stop)
        start = max(0, len(detok.text) - len(detok.last_delta) - longest + 1)
        found = [(detok.text.find(s, start), s) for s in request.stop]
        found = [(pos, s) for pos, s in found if pos >= 0]
        if not found:
            return
        pos, stop = min(found)
        detok.text = detok.text[:pos + len(stop) if params.include_stop_str_in_output else pos]
        if sample.finish_reason is None:
            metrics = self.engine.finish_completion(request_id, index, "stop")
            if metrics.finished_time > 0:
                request.final_metrics = metrics
        sample.finish_reason = "stop"
