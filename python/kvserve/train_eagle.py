"""Training an EAGLE-3 head for a Llama-family target (Li et al., 2025, "EAGLE-3: Scaling up
Inference Acceleration of Large Language Models via Training-Time Test"), written in the layout
the published heads use, which `speculative_method="eagle3"` reads (kvserve.loader.eagle3_weights).

The target is frozen and runs in transformers over windows of the corpus; its residual streams
entering three layers (low, middle, high) are the head's input, computed online for every batch.
The head is one Llama decoder layer whose q/k/v read the normed token embedding (the target's
embedding, frozen) beside the normed state; `fc` maps the three streams to one state. Row i of a
window reads the target's state at position i and the embedding of token i + 1, and predicts
token i + 2 (the target's distribution at position i + 1 over the draft vocabulary, a soft
cross entropy).

Training-time test: at inference the head chains on its own outputs, so training runs
`ttt_steps` steps. Step j's row i reads the embedding of token i + 1 + j and the head's own
output of step j - 1 at row i (not the target's state), sits at position i + j and predicts token
i + 2 + j; it attends to the step-0 rows at positions <= i and to its own chain's rows of steps
1..j, which is what it sees when drafting. Step j's loss is weighted 0.8^j (the paper's).

Self-distillation (generated_windows > 0): the windows are then the target's own continuations
of corpus prompts, generated with kvserve before training, so the head learns on the text it
will draft for.

The draft vocabulary is the `draft_vocab_size` most frequent tokens of the training text (all of
them when it is the target's size), mapped to target ids by `d2t`.

    kvserve.train_eagle.train_eagle("target", "corpus.txt", "head", steps=800)
    python -m kvserve train-eagle --target DIR --corpus FILE --out DIR [--steps N] ...
"""

from __future__ import annotations

import copy
import csv
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from kvserve import training


@dataclass(frozen=True)
class EagleTrainConfig:
    steps: int = 800
    batch_size: int = 8
    seq_len: int = 256
    ttt_steps: int = 3           # training-time test steps (1: no chaining)
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    draft_vocab_size: int = 0    # 0: the target's vocabulary
    aux_layers: tuple[int, ...] = field(default_factory=tuple)  # (): low, middle, high
    validation_fraction: float = 0.1
    eval_every: int = 50
    eval_batches: int = 8        # batches of held-out windows per evaluation (0: all)
    patience: int = 4            # evaluations without a better held-out loss before stopping
    max_minutes: float = 0.0     # stop (after an evaluation) once training took this long; 0: no
    # limit. With a limit the learning-rate schedule spans the steps that fit in it (measured
    # over the first steps), so that it decays fully before the time runs out.
    seed: int = 0
    device: str = "cpu"
    init_from: str = ""          # a written head to start from (fresh optimizer and schedule)
    # Windows the target wrote itself (self-distillation): 0 trains on corpus windows; N > 0
    # trains on N windows of the target's continuations of corpus prompts (sampled at
    # generate_temperature; 0: greedy), generated once with kvserve before training, and
    # validates on continuations of held-out prompts.
    generated_windows: int = 0
    generate_temperature: float = 0.0

    def check(self) -> None:
        for name in ("steps", "batch_size", "eval_every", "ttt_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.seq_len, int) or self.seq_len < self.ttt_steps + 3:
            raise ValueError(f"seq_len must be an integer >= ttt_steps + 3, got {self.seq_len!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if (self.patience < 0 or self.eval_batches < 0 or self.warmup_steps < 0
                or self.max_minutes < 0):
            raise ValueError("patience, eval_batches, warmup_steps and max_minutes must be "
                             "non-negative")
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size must be >= 0, got {self.draft_vocab_size}")
        if not isinstance(self.generated_windows, int) or self.generated_windows < 0:
            raise ValueError(f"generated_windows must be an integer >= 0, got "
                             f"{self.generated_windows!r}")
        if not self.generate_temperature >= 0:
            raise ValueError(f"generate_temperature must be >= 0, got "
                             f"{self.generate_temperature}")


def default_aux_layers(num_layers: int) -> list[int]:
    """Low, middle and high streams: vLLM's layers 2, N / 2 and N - 3 where they differ
    (N >= 8), else 1, N / 2 and N - 1."""
    if num_layers >= 8:
        return [2, num_layers // 2, num_layers - 3]
    if num_layers < 3:
        raise ValueError(f"an EAGLE-3 head reads three streams; the target has {num_layers} "
                         "layers")
    return [1, num_layers // 2, num_layers - 1]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Eagle3Draft(nn.Module):
    """The head in PyTorch, named as the published heads name their tensors (state_dict())."""

    def __init__(self, target_config, draft_vocab_size: int, streams: int):
        super().__init__()
        c = target_config
        hidden, inter = c.hidden_size, c.intermediate_size
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or hidden // self.heads
        self.eps = c.rms_norm_eps
        rope = getattr(c, "rope_parameters", None) or {}
        self.rope_theta = float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))

        def norm():
            return nn.Parameter(torch.ones(hidden))

        self.fc = nn.Linear(streams * hidden, hidden, bias=False)
        self.midlayer = nn.Module()
        layer = self.midlayer
        layer.input_layernorm = nn.Module()
        layer.input_layernorm.weight = norm()
        layer.hidden_norm = nn.Module()
        layer.hidden_norm.weight = norm()
        layer.post_attention_layernorm = nn.Module()
        layer.post_attention_layernorm.weight = norm()
        layer.self_attn = nn.Module()
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer.self_attn.q_proj = nn.Linear(2 * hidden, q, bias=False)
        layer.self_attn.k_proj = nn.Linear(2 * hidden, kv, bias=False)
        layer.self_attn.v_proj = nn.Linear(2 * hidden, kv, bias=False)
        layer.self_attn.o_proj = nn.Linear(q, hidden, bias=False)
        layer.mlp = nn.Module()
        layer.mlp.gate_proj = nn.Linear(hidden, inter, bias=False)
        layer.mlp.up_proj = nn.Linear(hidden, inter, bias=False)
        layer.mlp.down_proj = nn.Linear(inter, hidden, bias=False)
        self.norm = nn.Module()
        self.norm.weight = norm()
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Llama's rotary embedding (halves) of x [B, heads, R, dim] at positions [R]."""
        dim = x.shape[-1]
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64,
                                                      device=x.device) / dim))
        angle = positions[:, None].double() * inv[None]
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        a, b = x[..., :dim // 2], x[..., dim // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    def forward(self, streams: torch.Tensor, embedded: torch.Tensor, steps: int
                ) -> list[torch.Tensor]:
        """Logits over the draft vocabulary of every training-time test step, [B, R, draft
        vocab] each, R = L - 1 rows for windows of L tokens: streams [B, L, 3 * hidden] (the
        target's), embedded [B, L, hidden] (the window's tokens through the target's
        embedding). Step j's row i predicts token i + 2 + j (rows past the window are
        computed on zero embeddings; the loss leaves them out)."""
        layer, attn = self.midlayer, self.midlayer.self_attn
        b, length, _ = embedded.shape
        rows = length - 1
        previous = self.fc(streams[:, :rows])
        # The token of step j's row i is i + 1 + j: zeros past the window.
        padded = F.pad(embedded, (0, 0, 0, steps))
        base = torch.arange(rows, device=embedded.device)
        causal = base[None, :] <= base[:, None]  # [query row, key row]
        scale = 1.0 / math.sqrt(self.head_dim)
        group = self.heads // self.kv_heads
        keys0 = values0 = None
        chain_keys, chain_values, logits = [], [], []
        for j in range(steps):
            tokens = padded[:, 1 + j:1 + j + rows]
            x = torch.cat([_rms(tokens, layer.input_layernorm.weight, self.eps),
                           _rms(previous, layer.hidden_norm.weight, self.eps)], -1)
            positions = base + j
            q = self.rope(attn.q_proj(x).view(b, rows, self.heads, self.head_dim)
                          .transpose(1, 2), positions)
            k = self.rope(attn.k_proj(x).view(b, rows, self.kv_heads, self.head_dim)
                          .transpose(1, 2), positions).repeat_interleave(group, 1)
            v = attn.v_proj(x).view(b, rows, self.kv_heads, self.head_dim).transpose(1, 2)
            v = v.repeat_interleave(group, 1)
            if j == 0:
                keys0, values0 = k, v
            else:
                chain_keys.append(k)
                chain_values.append(v)
            # Scores against the step-0 rows at positions <= i, then against row i of each
            # chain step 1..j (the diagonal), one softmax over both.
            scores = (q @ keys0.transpose(-1, -2)) * scale
            scores = scores.masked_fill(~causal, float("-inf"))
            diagonal = [((q * ck).sum(-1, keepdim=True) * scale) for ck in chain_keys]
            weights = torch.cat([scores, *diagonal], -1).softmax(-1)
            out = weights[..., :rows] @ values0
            for s, cv in enumerate(chain_values):
                out = out + weights[..., rows + s:rows + s + 1] * cv
            out = out.transpose(1, 2).reshape(b, rows, -1)
            residual = previous + attn.o_proj(out)
            h = _rms(residual, layer.post_attention_layernorm.weight, self.eps)
            residual = residual + layer.mlp.down_proj(
                F.silu(layer.mlp.gate_proj(h)) * layer.mlp.up_proj(h))
            logits.append(self.lm_head(_rms(residual, self.norm.weight, self.eps)))
            previous = residual
        return logits


def draft_vocabulary(ids: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent ids of the training text (ties to the lower id), sorted: the
    target id of each draft id."""
    counts = torch.bincount(ids, minlength=vocab_size).double()
    counts -= torch.arange(vocab_size, dtype=torch.float64) * 1e-9  # ties: lower ids first
    return counts.topk(size).indices.sort().values


class _Target:
    """The frozen target in transformers: its streams entering `aux` layers and its logits."""

    def __init__(self, target_dir: Path, aux: list[int], device: torch.device):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        self.model.to(device).eval().requires_grad_(False)
        self.aux = aux

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(streams [B, L, 3 * hidden], embedded [B, L, hidden], logits [B, L, vocab])."""
        out = self.model(tokens, output_hidden_states=True, use_cache=False)
        streams = torch.cat([out.hidden_states[i] for i in self.aux], -1)
        return streams, self.model.get_input_embeddings()(tokens), out.logits.float()


def ttt_loss(logits: list[torch.Tensor], target_logits: torch.Tensor, draft_ids: torch.Tensor
             ) -> tuple[torch.Tensor, list[float], float]:
    """(the weighted soft cross entropy over the steps, each step's greedy agreement, the loss's
    floor): step j's row i against the target's distribution at position i + 1 + j over the
    draft vocabulary (renormalized there), rows whose target lies inside the window. The floor
    is the same weighting of the target's own entropies (the loss minus it is a KL
    divergence)."""
    rows = logits[0].shape[1]
    total, floor, weight_sum, agreement = 0.0, 0.0, 0.0, []
    for j, step in enumerate(logits):
        valid = rows - 1 - j  # rows i with i + 1 + j <= L - 1 = rows
        if valid <= 0:
            break
        want_logits = target_logits[:, 1 + j:1 + j + valid][..., draft_ids]
        want = want_logits.softmax(-1)
        got = step[:, :valid].float().log_softmax(-1)
        weight = 0.8 ** j
        total = total + weight * -(want * got).sum(-1).mean()
        floor += weight * -(want * want_logits.log_softmax(-1)).sum(-1).mean().item()
        weight_sum += weight
        agreement.append((got.argmax(-1) == want.argmax(-1)).double().mean().item())
    return total / weight_sum, agreement, floor / weight_sum


def train_eagle(target_dir: str | Path, corpus: str | Path, out_dir: str | Path,
                config: EagleTrainConfig | None = None, *, progress: bool = True,
                resume: bool = False) -> dict:
    """Trains an EAGLE-3 head for the target on the corpus and writes the best one (by held-out
    loss) to out_dir: config.json, model.safetensors, eagle_log.csv and eagle.json (the summary,
    also returned). At every evaluation the run's state (the head as it is, the optimizer, the
    step, the best head so far, the sampler) goes to out_dir/training_state.pt; `resume`
    continues from it up to config.steps (which may exceed the first run's), the log appended
    to, max_minutes counting this run's time. config.init_from starts instead from the weights
    of a head written before (the same draft vocabulary), with a fresh optimizer and schedule."""
    from tqdm import tqdm

    from kvserve.tokenizer import Tokenizer

    config = config or EagleTrainConfig()
    config.check()
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    if out_dir.resolve() == target_dir.resolve():
        raise ValueError("--out must be another directory than --target")
    started = time.monotonic()
    torch.manual_seed(config.seed)
    gen = torch.Generator().manual_seed(config.seed)
    device = torch.device(config.device)

    hf_config = json.loads((target_dir / "config.json").read_text())
    if "LlamaForCausalLM" not in (hf_config.get("architectures") or []):
        raise ValueError(f"train-eagle trains heads for Llama targets; {target_dir} is "
                         f"{hf_config.get('architectures')}")
    aux = list(config.aux_layers) or default_aux_layers(hf_config["num_hidden_layers"])
    if len(aux) != 3 or not all(0 <= i < hf_config["num_hidden_layers"] for i in aux):
        raise ValueError(f"aux_layers must be three layers of the target's "
                         f"{hf_config['num_hidden_layers']}, got {aux}")
    target = _Target(target_dir, aux, device)
    bos = target.model.config.bos_token_id
    if bos is None:
        raise ValueError(f"{target_dir}/config.json has no bos_token_id to start windows with")
    train_text, val_text = training.read_split(corpus, config.validation_fraction)
    tokenizer = Tokenizer.from_model_dir(target_dir)
    train_ids = torch.tensor(tokenizer.encode(train_text, add_special_tokens=False))
    val_ids = torch.tensor(tokenizer.encode(val_text, add_special_tokens=False))
    val_windows = training.validation_windows(val_ids, config.seq_len, bos)
    train_windows, generation_s = None, 0.0
    if config.generated_windows:
        out_dir.mkdir(parents=True, exist_ok=True)
        held_out = (config.eval_batches or 8) * config.batch_size
        generation_started = time.monotonic()
        train_windows, val_windows = _generated(
            out_dir / "generated_windows.pt", target_dir, config, train_ids, val_ids,
            held_out, bos, device)
        generation_s = time.monotonic() - generation_started
    vocab = target.model.config.vocab_size
    size = config.draft_vocab_size or vocab
    if size > vocab:
        raise ValueError(f"draft_vocab_size {size} exceeds the target's vocabulary ({vocab})")
    draft_ids = draft_vocabulary(train_ids, vocab, size).to(device)

    head = Eagle3Draft(target.model.config, size, len(aux)).to(device).train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    state_path = out_dir / "training_state.pt"
    saved = _load_state(state_path, config, size) if resume else None
    if config.init_from and saved is None:
        head.load_state_dict(_head_weights(Path(config.init_from), draft_ids, aux))

    def run(batch: torch.Tensor) -> tuple[torch.Tensor, list[float], float]:
        streams, embedded, target_logits = target(batch.to(device))
        return ttt_loss(head(streams, embedded, config.ttt_steps), target_logits, draft_ids)

    windows = val_windows[:config.eval_batches * config.batch_size] \
        if config.eval_batches else val_windows
    floors = []

    @torch.no_grad()
    def evaluate() -> tuple[float, list[float]]:
        head.eval()
        losses, agreements = [], []
        floors.clear()
        for chunk in windows.split(config.batch_size):
            loss, agreement, floor = run(chunk)
            losses.append(loss.item() * len(chunk))
            agreements.append([a * len(chunk) for a in agreement])
            floors.append(floor * len(chunk))
        head.train()
        n = len(windows)
        return sum(losses) / n, [sum(col) / n for col in zip(*agreements)]

    evaluation_started = time.monotonic()
    if saved is None:
        val_loss, val_agree = evaluate()
        before = {"validation_loss": val_loss, "agreement": val_agree}
        best = (val_loss, 0, copy.deepcopy(head.state_dict()), val_agree)
        stale, first, spent = 0, 0, 0.0
    else:
        head.load_state_dict(saved["head"])
        optimizer.load_state_dict(saved["optimizer"])
        gen.set_state(saved["generator"])
        before, best, stale = saved["before"], saved["best"], saved["stale"]
        first, spent = saved["step"], saved["elapsed_s"]
        val_loss, val_agree = best[0], best[3]
        evaluate()  # for the floor of the held-out windows, as a first run computes it
    evaluation_s = time.monotonic() - evaluation_started
    floor = sum(floors) / len(windows)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps_run, stopped_early = first, False
    # The schedule's length: config.steps, or with a time limit the steps that fit in it.
    total, warmup, fitted_at = config.steps, config.warmup_steps, first + 5
    loop_started = time.monotonic()

    def save_state() -> None:
        torch.save({"config": asdict(config), "draft_vocab_size": size, "step": steps_run,
                    "head": head.state_dict(), "optimizer": optimizer.state_dict(),
                    "generator": gen.get_state(), "before": before, "best": best,
                    "stale": stale, "elapsed_s": spent + time.monotonic() - started},
                   state_path)

    with open(out_dir / "eagle_log.csv", "a" if saved else "w", newline="") as log_file, \
            tqdm(range(first, config.steps), desc="eagle-3", unit="step", file=sys.stderr,
                 disable=not progress) as bar:
        log = csv.writer(log_file)
        if saved is None:
            log.writerow(["step", "train_loss", "val_loss", "val_agreement", "lr", "elapsed_s"])
            log.writerow([0, "", f"{val_loss:.4f}", " ".join(f"{a:.3f}" for a in val_agree),
                          "", "0.0"])
        for step in bar:
            if config.max_minutes and step == fitted_at:
                total = training.steps_in_budget(
                    done=step, total=config.steps,
                    per_step_s=(time.monotonic() - loop_started) / (step - first),
                    budget_s=60 * config.max_minutes - (time.monotonic() - started),
                    evaluation_s=evaluation_s, eval_every=config.eval_every)
                warmup = min(warmup, total // 10)
                bar.total = total
            if step >= total:
                break
            lr = training.schedule(optimizer, step, config.lr, total, warmup,
                                   config.min_lr_ratio)
            batch = training.sample_batch(train_ids, config.batch_size, config.seq_len, gen, bos) \
                if train_windows is None else \
                train_windows[torch.randint(len(train_windows), (config.batch_size,),
                                            generator=gen)]
            loss, _, _ = run(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            steps_run = step + 1
            out_of_time = bool(config.max_minutes) and \
                time.monotonic() - started > 60 * config.max_minutes
            evaluated = (steps_run % config.eval_every == 0 or steps_run == total
                         or out_of_time)
            if evaluated:
                val_loss, val_agree = evaluate()
                if val_loss < best[0]:
                    best, stale = (val_loss, steps_run, copy.deepcopy(head.state_dict()),
                                   val_agree), 0
                else:
                    stale += 1
                save_state()
            bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{val_loss:.3f}",
                            agree=f"{val_agree[0]:.2f}")
            log.writerow([steps_run, f"{loss.item():.4f}", f"{val_loss:.4f}" if evaluated else "",
                          " ".join(f"{a:.3f}" for a in val_agree) if evaluated else "",
                          f"{lr:.3e}", f"{spent + time.monotonic() - started:.1f}"])
            log_file.flush()
            if (evaluated and config.patience and stale >= config.patience) or out_of_time:
                stopped_early = True
                break
    best_loss, best_step, state, best_agree = best
    write_head(out_dir, hf_config, aux, draft_ids.cpu(), state)
    summary = {
        "target": str(target_dir), "corpus": str(corpus), "config": asdict(config),
        "aux_layers": aux, "draft_vocab_size": size,
        "parameters": sum(p.numel() for p in head.parameters()),
        "train_tokens": len(train_ids), "validation_tokens": len(val_ids),
        "generated_windows": config.generated_windows, "generation_s": round(generation_s, 1),
        "steps_run": steps_run, "schedule_steps": total, "stopped_early": stopped_early,
        "best_step": best_step,
        "tokens_seen": steps_run * config.batch_size * config.seq_len,
        "resumed_from_step": first,
        "validation_loss_floor": round(floor, 4),
        "before": {"validation_loss": round(before["validation_loss"], 4),
                   "agreement": [round(a, 4) for a in before["agreement"]]},
        "after": {"validation_loss": round(best_loss, 4),
                  "agreement": [round(a, 4) for a in best_agree]},
        "wall_time_s": round(spent + time.monotonic() - started, 1),
    }
    (out_dir / "eagle.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _load_state(path: Path, config: EagleTrainConfig, size: int) -> dict:
    """A run's training_state.pt, checked against this run's config (all but the steps, the
    time limit and the patience may not change)."""
    if not path.is_file():
        raise ValueError(f"--resume: {path} does not exist (a run writes it at each evaluation)")
    saved = torch.load(path, weights_only=False)
    free = {"steps", "max_minutes", "patience", "init_from"}
    then, now = saved["config"], asdict(config)
    changed = sorted(k for k in now if k not in free and then.get(k) != now[k])
    if changed or saved["draft_vocab_size"] != size:
        raise ValueError(f"--resume: the run in {path.parent} was trained with other settings "
                         f"({', '.join(changed) or 'draft vocabulary'}); only --steps, "
                         f"--max-minutes and --patience may change")
    if saved["step"] >= config.steps:
        raise ValueError(f"--resume: the run already took {saved['step']} steps; give --steps "
                         f"more than that")
    return saved


def generate_windows(target_dir: Path, ids: torch.Tensor, count: int, seq_len: int, bos: int,
                     temperature: float, seed: int, device: torch.device, llm=None
                     ) -> torch.Tensor:
    """[count, seq_len] windows the target wrote: BOS, a run of 8 to seq_len / 2 tokens of `ids`
    from a random offset (the prompt), then the target's own continuation up to seq_len tokens
    (kvserve, batched; greedy at temperature 0, else sampled with a seed per window). llm: the
    target loaded already (a kvserve.LLM with max_model_len >= seq_len), else it is loaded."""
    import random

    from kvserve import LLM, SamplingParams

    longest = max(8, seq_len // 2)
    if len(ids) < longest:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than a prompt of {longest}")
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(count):
        length = rng.randint(8, longest)
        start = rng.randrange(0, len(ids) - length + 1)
        prompts.append([bos] + ids[start:start + length].tolist())
        params.append(SamplingParams(temperature=temperature, seed=seed * 1_000_003 + i,
                                     max_tokens=seq_len - 1 - length, ignore_eos=True))
    if llm is None:
        llm = LLM(target_dir, dtype="float32", device=str(device), max_model_len=seq_len,
                  max_num_seqs=64)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return torch.tensor([p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs)],
                        dtype=torch.long)


def _generated(path: Path, target_dir: Path, config: EagleTrainConfig, train_ids: torch.Tensor,
               val_ids: torch.Tensor, held_out: int, bos: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's generated training and held-out windows: read from `path` when a run with the
    same settings wrote them there (a resumed run), else generated and written there."""
    from kvserve import LLM

    key = {"target": str(target_dir.resolve()), "count": config.generated_windows,
           "held_out": held_out, "seq_len": config.seq_len,
           "temperature": config.generate_temperature, "seed": config.seed}
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        if saved["key"] == key:
            return saved["train"], saved["validation"]
    llm = LLM(target_dir, dtype="float32", device=str(device), max_model_len=config.seq_len,
              max_num_seqs=64)
    train = generate_windows(target_dir, train_ids, config.generated_windows, config.seq_len,
                             bos, config.generate_temperature, config.seed, device, llm)
    validation = generate_windows(target_dir, val_ids, held_out, config.seq_len, bos,
                                  config.generate_temperature, config.seed + 1, device, llm)
    torch.save({"key": key, "train": train, "validation": validation}, path)
    return train, validation


def _head_weights(head_dir: Path, draft_ids: torch.Tensor, aux: list[int]) -> dict:
    """The Eagle3Draft state of a head written by write_head, if it drafts this run's
    vocabulary from the same target layers."""
    from safetensors.torch import load_file

    config = json.loads((head_dir / "config.json").read_text())
    tensors = load_file(head_dir / "model.safetensors")
    d2t = tensors.pop("d2t")
    tensors.pop("t2d")
    same_vocabulary = len(d2t) == len(draft_ids) and torch.equal(
        d2t + torch.arange(len(d2t)), draft_ids.cpu())
    if not same_vocabulary or config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] != aux:
        raise ValueError(f"--init-from {head_dir}: that head drafts another vocabulary or reads "
                         f"other layers than this run's")
    return tensors


def write_head(out_dir: str | Path, target: dict, aux: list[int], draft_ids: torch.Tensor,
               state: dict) -> None:
    """Writes a head (an Eagle3Draft's state_dict) for the target whose config.json is `target`
    to out_dir: config.json and model.safetensors in the published heads' layout; draft_ids: the
    target id of each draft id."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    size, vocab = len(draft_ids), target["vocab_size"]
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
            "rope_parameters", "vocab_size", "bos_token_id", "eos_token_id")
    config = {k: target[k] for k in keep if k in target}
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                  num_hidden_layers=1, draft_vocab_size=size, hidden_act="silu",
                  tie_word_embeddings=False,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": aux})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {name: t.detach().float().cpu().contiguous() for name, t in state.items()}
    tensors["d2t"] = draft_ids - torch.arange(size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
