"""Training EAGLE-3 heads (kvserve.train_eagle, `kvserve train-eagle`): the training forward's
every training-time test step equals the head drafting at inference (the pure-torch port of
test_eagle3.py, chained on the window's own tokens), so what trains is what drafts; training on a
small corpus lowers the held-out loss, writes a head kvserve loads, whose greedy speculative
output equals plain decoding with drafts accepted; a resumed run ends where the same run taken
straight through does; bad arguments are clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.testing.checkpoints import make_checkpoint
from kvserve.train_eagle import (Eagle3Draft, EagleTrainConfig, default_aux_layers,
                                 draft_vocabulary, train_eagle, ttt_loss, write_head)
from tests.models.test_eagle3 import Port

transformers = pytest.importorskip("transformers")

VOCAB = 16


def random_head(target_dir, draft_ids, aux, seed=0):
    from transformers import AutoConfig

    torch.manual_seed(seed)
    head = Eagle3Draft(AutoConfig.from_pretrained(target_dir), len(draft_ids), len(aux))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    return head


@pytest.mark.parametrize("draft_size", [VOCAB, 13])
def test_training_steps_equal_the_chained_head(tmp_path, draft_size):
    target = make_checkpoint(tmp_path / "target", "LlamaForCausalLM", vocab_size=VOCAB,
                             num_hidden_layers=4, with_tokenizer=False)
    aux = [1, 2, 3]
    g = torch.Generator().manual_seed(0)
    draft_ids = torch.randperm(VOCAB, generator=g)[:draft_size].sort().values
    head = random_head(target, draft_ids, aux)
    config = json.loads((target / "config.json").read_text())
    write_head(tmp_path / "head", config, aux, draft_ids, head.state_dict())
    port = Port(target, tmp_path / "head")
    tokens = torch.randint(0, VOCAB, (1, 12), generator=g)
    hf = port.hf
    with torch.no_grad():
        out = hf(tokens, output_hidden_states=True)
        streams = torch.cat([out.hidden_states[i] for i in aux], -1)
        steps = head(streams, hf.model.embed_tokens(tokens), 3)
    row_ids = tokens[0].tolist()
    states = port.target_states(row_ids)
    for i in (0, 4, 8):  # the chain from position i, on the window's own next tokens
        rows, previous = row_ids[1:i + 2], states[:i + 1]
        for j in range(3):
            if i + 2 + j > len(row_ids):
                break
            normed, prenorm = port.rows(rows, previous, torch.arange(len(rows)))
            want = port.logits(normed[-1:])[0, draft_ids]
            torch.testing.assert_close(steps[j][0, i], want, rtol=1e-4, atol=1e-4)
            if i + 2 + j < len(row_ids):
                rows = rows + [row_ids[i + 2 + j]]
                previous = torch.cat([previous, prenorm[-1:]])


def test_loss_reads_the_target_at_each_steps_position():
    """Step j's row i is scored against the target's distribution at position i + 1 + j."""
    rows, vocab = 6, 5
    target = torch.randn(1, rows + 1, vocab)
    exact = [target[:, 1 + j:1 + j + rows].clone() for j in range(3)]  # logits = the target's
    loss, agreement, floor = ttt_loss(exact, target, torch.arange(vocab))
    entropy = [-(target[:, 1 + j:rows].softmax(-1) * target[:, 1 + j:rows].log_softmax(-1))
               .sum(-1).mean() for j in range(3)]
    want = sum(0.8 ** j * entropy[j] for j in range(3)) / sum(0.8 ** j for j in range(3))
    torch.testing.assert_close(loss, want)
    assert agreement == [1.0, 1.0, 1.0] and floor == pytest.approx(loss.item(), rel=1e-5)
    worse, _, _ = ttt_loss([torch.zeros_like(e) for e in exact], target, torch.arange(vocab))
    assert worse > loss


def test_draft_vocabulary_takes_the_most_frequent_tokens():
    ids = torch.tensor([5, 5, 5, 2, 2, 7, 7, 9, 1])
    assert draft_vocabulary(ids, 10, 3).tolist() == [2, 5, 7]  # 7 before 9 and 1: ties go low
    assert draft_vocabulary(ids, 10, 10).tolist() == list(range(10))


def test_default_aux_layers():
    assert default_aux_layers(32) == [2, 16, 29]
    assert default_aux_layers(6) == [1, 3, 5]
    with pytest.raises(ValueError, match="reads three streams"):
        default_aux_layers(2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-eagle")
    target = make_checkpoint(root / "target", "LlamaForCausalLM", num_hidden_layers=4,
                             hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, initializer_range=0.1)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "theta"]
    g = torch.Generator().manual_seed(0)
    lines = [" ".join(words[(i * 3 + int(j)) % 8] for j in torch.randint(0, 3, (9,), generator=g))
             for i in range(600)]
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(lines) + "\n")
    config = EagleTrainConfig(steps=40, batch_size=4, seq_len=48, eval_every=20, eval_batches=2,
                              draft_vocab_size=200, warmup_steps=5, lr=3e-3)
    summary = train_eagle(target, corpus, root / "head", config, progress=False)
    return target, root / "head", summary


def test_training_lowers_the_held_out_loss_and_writes_a_head(trained):
    target, head, summary = trained
    floor = summary["validation_loss_floor"]  # the target's entropy: the KL is what is left
    assert summary["after"]["validation_loss"] - floor \
        < 0.5 * (summary["before"]["validation_loss"] - floor)
    assert summary["steps_run"] == 40 and summary["draft_vocab_size"] == 200
    assert len(summary["after"]["agreement"]) == 3
    config = json.loads((head / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert (head / "eagle_log.csv").read_text().count("\n") == 42  # header, before, 40 steps


def test_trained_head_drafts_exactly(trained):
    target, head, _ = trained
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[1, 40, 41, 42, 43, 40, 41], [1, 50, 60, 70]]
    want = [o.outputs[0].token_ids for o in
            LLM(target, dtype="float32").generate(prompts, params, use_tqdm=False)]
    llm = LLM(target, dtype="float32", speculative_method="eagle3", speculative_model=head,
              num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] \
        == want
    assert llm.llm_engine.get_stats().num_draft_tokens > 0


def test_bad_arguments(tmp_path, trained):
    target, _, _ = trained
    corpus = tmp_path / "c.txt"
    corpus.write_text("a b c\n" * 3000)
    with pytest.raises(ValueError, match="seq_len must be an integer >= ttt_steps \\+ 3"):
        train_eagle(target, corpus, tmp_path / "o", EagleTrainConfig(seq_len=4))
    with pytest.raises(ValueError, match="aux_layers must be three layers of the target's 4"):
        train_eagle(target, corpus, tmp_path / "o", EagleTrainConfig(aux_layers=(1, 2, 4)))
    with pytest.raises(ValueError, match="exceeds the target's vocabulary"):
        train_eagle(target, corpus, tmp_path / "o", EagleTrainConfig(draft_vocab_size=10**6))
    short = tmp_path / "short.txt"
    short.write_text("a b c\n" * 100)
    with pytest.raises(ValueError, match="fewer than a window of 256"):
        train_eagle(target, short, tmp_path / "o", EagleTrainConfig())
    with pytest.raises(ValueError, match="another directory than --target"):
        train_eagle(target, corpus, target, EagleTrainConfig())
    gemma = make_checkpoint(tmp_path / "gemma", "Gemma2ForCausalLM", with_tokenizer=False)
    with pytest.raises(ValueError, match="trains heads for Llama targets"):
        train_eagle(gemma, corpus, tmp_path / "o", EagleTrainConfig())


def test_command_line(tmp_path, trained, capsys):
    from kvserve.cli import main

    target, _, _ = trained
    corpus = tmp_path / "c.txt"
    corpus.write_text("alpha beta gamma delta\n" * 400)
    with pytest.raises(SystemExit) as done:
        main(["train-eagle", "--target", str(target), "--corpus", str(corpus), "--out",
              str(tmp_path / "head"), "--steps", "2", "--seq-len", "32", "--batch-size", "2",
              "--eval-every", "1", "--eval-batches", "1", "--aux-layers", "0", "2", "3",
              "--draft-vocab-size", "50", "--ttt-steps", "2"])
    assert done.value.code == 0
    assert "agreement with the target's greedy token by step" in capsys.readouterr().out
    summary = json.loads((tmp_path / "head" / "eagle.json").read_text())
    assert summary["aux_layers"] == [0, 2, 3] and summary["draft_vocab_size"] == 50
    assert len(summary["after"]["agreement"]) == 2
    with pytest.raises(SystemExit):  # a time limit stops after the first step's evaluation
        main(["train-eagle", "--target", str(target), "--corpus", str(corpus), "--out",
              str(tmp_path / "timed"), "--steps", "50", "--seq-len", "32", "--batch-size", "2",
              "--eval-batches", "1", "--max-minutes", "1e-9"])
    timed = json.loads((tmp_path / "timed" / "eagle.json").read_text())
    assert timed["steps_run"] == 1 and timed["stopped_early"]


def test_resume_continues_the_run_exactly(tmp_path, trained):
    """A run stopped after its first step (a time limit) and resumed ends with the weights of
    the same run taken straight through; the log goes on; only --steps, --max-minutes and
    --patience may change."""
    from dataclasses import replace

    target, _, _ = trained
    corpus = tmp_path / "c.txt"
    corpus.write_text("alpha beta gamma delta kappa\n" * 400)
    config = EagleTrainConfig(steps=6, batch_size=2, seq_len=32, eval_every=3, eval_batches=1,
                              draft_vocab_size=50, aux_layers=(0, 2, 3), ttt_steps=2,
                              warmup_steps=2)
    train_eagle(target, corpus, tmp_path / "straight", config, progress=False)
    cut = train_eagle(target, corpus, tmp_path / "cut", replace(config, max_minutes=1e-9),
                      progress=False)
    assert cut["steps_run"] == 1 and cut["stopped_early"]
    done = train_eagle(target, corpus, tmp_path / "cut", config, progress=False, resume=True)
    assert done["steps_run"] == 6 and done["resumed_from_step"] == 1
    assert done["before"] == cut["before"]
    straight = torch.load(tmp_path / "straight" / "training_state.pt", weights_only=False)
    resumed = torch.load(tmp_path / "cut" / "training_state.pt", weights_only=False)
    for name, weight in straight["head"].items():
        assert torch.equal(weight, resumed["head"][name]), name
    log = (tmp_path / "cut" / "eagle_log.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in log[1:]] == [str(i) for i in range(7)]
    with pytest.raises(ValueError, match=r"other settings \(lr\)"):
        train_eagle(target, corpus, tmp_path / "cut", replace(config, steps=9, lr=0.5),
                    progress=False, resume=True)
    with pytest.raises(ValueError, match="already took 6 steps"):
        train_eagle(target, corpus, tmp_path / "cut", config, progress=False, resume=True)
    with pytest.raises(ValueError, match="does not exist"):
        train_eagle(target, corpus, tmp_path / "none", config, progress=False, resume=True)


def test_init_from_starts_at_a_written_head(tmp_path, trained):
    """--init-from loads a written head: before its first step the run's held-out loss is the
    head's own; a head of another draft vocabulary is refused."""
    from dataclasses import replace

    target, head, summary = trained
    corpus = target.parent / "corpus.txt"
    config = EagleTrainConfig(steps=1, batch_size=4, seq_len=48, eval_every=20, eval_batches=2,
                              draft_vocab_size=200, warmup_steps=5, lr=3e-3, init_from=str(head))
    again = train_eagle(target, corpus, tmp_path / "again", config, progress=False)
    assert again["before"]["validation_loss"] == pytest.approx(
        summary["after"]["validation_loss"], abs=2e-4)
    with pytest.raises(ValueError, match="another vocabulary"):
        train_eagle(target, corpus, tmp_path / "other", replace(config, draft_vocab_size=100),
                    progress=False)


def test_steps_in_budget():
    from kvserve.training import steps_in_budget

    # 5 steps run, 100 s left, 1 s a step and 5 s an evaluation every 10 steps: 1.5 s a step.
    assert steps_in_budget(5, 1000, 1.0, 100.0, 5.0, 10, margin=1.0) == 5 + 66
    assert steps_in_budget(5, 40, 1.0, 100.0, 5.0, 10) == 40  # all fit
    assert steps_in_budget(5, 1000, 1.0, -3.0) == 6  # out of time: at least one more step


def test_time_limit_fits_the_schedule(tmp_path, trained):
    """With --max-minutes the cosine schedule spans the steps that fit (timed over the first
    five), not --steps: the learning rate the log records follows that length."""
    from kvserve.training import learning_rate

    target, _, _ = trained
    corpus = tmp_path / "c.txt"
    corpus.write_text("alpha beta gamma delta kappa\n" * 400)
    config = EagleTrainConfig(steps=10**6, batch_size=2, seq_len=32, eval_every=20,
                              eval_batches=1, draft_vocab_size=50, aux_layers=(0, 2, 3),
                              ttt_steps=2, warmup_steps=30, max_minutes=0.1, patience=0)
    done = train_eagle(target, corpus, tmp_path / "head", config, progress=False)
    total = done["schedule_steps"]
    assert 5 < total < 10**6 and done["steps_run"] <= total
    warmup = min(config.warmup_steps, total // 10)
    rows = (tmp_path / "head" / "eagle_log.csv").read_text().splitlines()[2:]
    for row in rows[5:]:
        step, lr = int(row.split(",")[0]), float(row.split(",")[4])
        assert lr == pytest.approx(learning_rate(step - 1, config.lr, total, warmup,
                                                 config.min_lr_ratio), rel=1e-3)


def test_generated_windows_are_the_targets_own_continuations(tmp_path, trained):
    """--generated-windows: the windows are a corpus prompt then the target's greedy
    continuation (what plain greedy decoding of that prompt gives), written beside the head and
    read back by a run with the same settings; training on them runs and records them."""
    from kvserve.train_eagle import generate_windows

    target, _, _ = trained
    ids = torch.arange(3, 300) % 97 + 3
    windows = generate_windows(target, ids, 5, 24, 1, 0.0, 0, torch.device("cpu"))
    assert windows.shape == (5, 24) and bool((windows[:, 0] == 1).all())
    plain = LLM(target, dtype="float32")

    def greedy(prompt, n):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids

    def is_run(seq):  # consecutive in ids
        return all(b - 3 == (a - 3 + 1) % 97 for a, b in zip(seq, seq[1:]))

    for row in windows.tolist():  # a prompt of 8 to 12 tokens, then its greedy continuation
        assert any(is_run(row[1:1 + n]) and greedy(row[:1 + n], 23 - n) == row[1 + n:]
                   for n in range(8, 13)), row
    corpus = tmp_path / "c.txt"
    corpus.write_text("alpha beta gamma delta kappa\n" * 400)
    config = EagleTrainConfig(steps=3, batch_size=2, seq_len=32, eval_every=3, eval_batches=1,
                              draft_vocab_size=50, aux_layers=(0, 2, 3), ttt_steps=2,
                              warmup_steps=1, generated_windows=6)
    done = train_eagle(target, corpus, tmp_path / "head", config, progress=False)
    assert done["generated_windows"] == 6 and done["steps_run"] == 3
    saved = torch.load(tmp_path / "head" / "generated_windows.pt", weights_only=True)
    assert saved["train"].shape == (6, 32) and saved["validation"].shape == (2, 32)
    with pytest.raises(ValueError, match="generated_windows must be an integer >= 0"):
        train_eagle(target, corpus, tmp_path / "o", EagleTrainConfig(generated_windows=-1))
