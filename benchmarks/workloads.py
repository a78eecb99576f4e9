"""Workload zoo: false alarms and detection delays of ddphooks' defaults on models the detector was never tuned on.

Nine small training setups outside the project's experiment, each trained as people train it, on
gloo CPU processes (``ddphooks.launch.spawn``) with ``ddphooks.attach(ddp)`` at its defaults
(detector on, replica check every 100 steps). Healthy runs must raise no alert; fault runs inject
one fault on one rank from FAULT_STEP and measure the steps until an alert names that rank.

    python benchmarks/workloads.py --smoke                          # every family, a few steps, W = 2
    python benchmarks/workloads.py --worlds 4 --healthy-runs 2      # a campaign (results appended, resumable)
    python benchmarks/workloads.py --summarize /work/runs/zoo/results.jsonl --json zoo.json
    python benchmarks/workloads.py --summarize /work/runs/zoo/results.jsonl --redetect   # this checkout's detector, offline
    python benchmarks/workloads.py --summarize /work/runs/zoo/results.jsonl --redetect --compact-wire 16   # as the compact wire
    python benchmarks/detection.py /work/runs/zoo/files              # d' and --oracle on the run files (--records)

Families (FAMILIES): cnn (BatchNorm, SGD momentum, step LR), gpt2 (transformers GPT-2, AdamW, warmup
+ cosine, dropout, clipping), bert (transformers BERT masked LM, linear warmup/decay), lora (peft LoRA
on a frozen tiny Llama), bf16 (MLP under bf16 autocast), moe (top-1 experts + a task head chosen per
batch, find_unused_parameters=True), heavy (regression with Student-t noise, df 1.5), mixture (Llama
LM on three domains drawn per rank per step), nanogpt (``ddphooks.models.tiny_gpt`` as nanoGPT's
character-level config trains it: AdamW, 20 warm-up steps then cosine decay to a tenth, clipping,
gradient accumulation over two micro-batches by ``require_backward_grad_sync``; issue 41's GPT). Faults (FAULTS), on FAULT_RANK from FAULT_STEP:
bitflip (an exponent bit flipped in 1e-3 of the largest trainable tensor's local gradient (moe: the trunk's), through
``param.register_hook``), labels (labels misaligned: shifted by one position or class, regression
targets permuted), stuck (the loader repeats the fault step's batch), precision (the rank trains
under bf16 autocast, or without it in the bf16 family), eval (the rank left in eval mode: dropout
off, BatchNorm on running statistics; families with dropout or BatchNorm), stale (the rank's
parameters reset to their copy of STALE_BACK steps earlier; the replica check, every 100 steps
by default, should name it at step 200), scale1.25 / scale1.5 / scale2 (every local gradient of the rank
multiplied by that factor, every step, all layers: a unit computing too large a result).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import ddphooks
from ddphooks.detect import Detector, DetectorConfig, Observation, detect_run
from ddphooks.experiment.report import read_run
from ddphooks.fleet import as_compact_records
from ddphooks.launch import spawn

# -- configuration (chosen before any result) -------------------------------------------------------
FAMILIES = ("cnn", "gpt2", "bert", "lora", "bf16", "moe", "heavy", "mixture", "nanogpt")
FAULTS = ("bitflip", "labels", "stuck", "precision", "eval", "stale", "scale1.25", "scale1.5", "scale2")
DROPOUT_FAMILIES = ("cnn", "gpt2", "bert", "lora", "mixture")  # where the eval fault changes anything
WORLDS = (2, 4, 8)
FAULT_STEP = 150  # first faulty step of every fault run
FAULT_STEPS = 230  # fault runs' length: 80 steps after the fault (the replica check at step 200 included)
HEALTHY_STEPS = 800  # healthy runs' length
FAULT_RANK = 1
STALE_BACK = 50  # the stale rank's weights are those of step FAULT_STEP - STALE_BACK
BITFLIP_FRACTION = 1e-3
# The bitflip's tensor where the largest is not used by every step: moe's largest are its experts,
# and the first of them was routed no sample in any run of the first campaign (no gradient, so the
# fault never ran); the trunk is what every sample passes through.
BITFLIP_TARGETS = {"moe": "trunk.weight"}
# Held-out seeds, fixed before the campaign ran: healthy run r of a family uses HEALTHY_SEEDS[r];
# fault run r of fault kind k uses FAULT_SEEDS[r] + 10 * k (each fault run is a different run before
# its fault, so every pre-fault step is a distinct healthy step). r = 10-19 (added at 8ec6cae,
# 2026-12-05, when every earlier seed had been run) start at 500, clear of 400 + 9 + 10 * 8. Healthy
# r = 20-29 (600-609, fixed on 2026-12-07 before any ran): a held-out set for the per-parameter
# allowance chosen on r = 18-19 (benchmarks/README.md, "The x1.5 one-layer fault"); every one of
# them has run since (the persistence CUSUM, "W = 2: a layer rise that lasts"). Healthy r = 30-49
# (610-629, fixed on 2026-12-07 after that): run on 2026-12-08, 3 false alarms in 144,000 steps
# (benchmarks/README.md, "The next held-out set, r = 30-49"). Healthy r = 50-69 (630-649, fixed on
# 2026-12-08 before any ran): the next held-out set.
HEALTHY_SEEDS = tuple(range(300, 320)) + tuple(range(600, 650))
FAULT_SEEDS = tuple(range(400, 410)) + tuple(range(500, 510))
OUT = "/work/runs/zoo"
VOCAB = 64
SEQ = 16


# -- synthetic data: learnable, shared "world" per seed, batches per (seed, rank, step) -------------
def markov_chain(seed: int, successors: int, vocab: int = VOCAB) -> np.ndarray:
    """A transition matrix in which each token has a few likely successors."""
    rng = np.random.default_rng([seed, 7, successors])
    matrix = np.full((vocab, vocab), 1e-3)
    for token in range(vocab):
        nxt = rng.choice(vocab, size=successors, replace=False)
        matrix[token, nxt] += rng.dirichlet(np.ones(successors))
    return matrix / matrix.sum(axis=1, keepdims=True)


def sample_chain(matrix: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    cumulative = matrix.cumsum(axis=1)
    out = np.empty((batch, length), dtype=np.int64)
    out[:, 0] = rng.integers(0, matrix.shape[0], size=batch)
    for position in range(1, length):
        u = rng.random(batch)[:, None]
        out[:, position] = np.minimum((cumulative[out[:, position - 1]] < u).sum(axis=1), matrix.shape[0] - 1)
    return out


def teacher(seed: int, inputs: int, outputs: int, hidden: int = 32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, 11, inputs, outputs])
    return rng.normal(size=(inputs, hidden)) / math.sqrt(inputs), rng.normal(size=(hidden, outputs)) / math.sqrt(hidden)


def apply_teacher(weights, x: np.ndarray) -> np.ndarray:
    w1, w2 = weights
    return np.tanh(x @ w1 * 2.0) @ w2


# -- models -----------------------------------------------------------------------------------------
class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )  # fmt: skip
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


class MLP(nn.Module):
    def __init__(self, inputs: int, hidden: int, outputs: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(inputs, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, outputs))

    def forward(self, x):
        return self.net(x)


class TaskMoE(nn.Module):
    """A trunk, a top-1 mixture of experts, and one head per task (the batch's task picks it)."""

    def __init__(self, inputs: int = 16, hidden: int = 32, experts: int = 4, tasks: int = 3, classes: int = 5) -> None:
        super().__init__()
        self.trunk = nn.Linear(inputs, hidden)
        self.router = nn.Linear(hidden, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.GELU()) for _ in range(experts))
        self.heads = nn.ModuleList(nn.Linear(hidden, classes) for _ in range(tasks))

    def forward(self, x, task: int):
        h = F.gelu(self.trunk(x))
        gates = self.router(h).softmax(-1)
        top, choice = gates.max(-1)
        mixed = torch.zeros_like(h)
        for index, expert in enumerate(self.experts):
            chosen = choice == index
            if chosen.any():  # an expert no sample chose gets no gradient on this rank this step
                mixed[chosen] = expert(h[chosen]) * top[chosen, None]
        return self.heads[task](h + mixed)


def build_model(family: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    if family == "cnn":
        return SmallCNN()
    if family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=None, eos_token_id=None
        )  # fmt: skip
        return GPT2LMHeadModel(config)
    if family == "bert":
        from transformers import BertConfig, BertForMaskedLM

        config = BertConfig(vocab_size=VOCAB + 1, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=32)
        return BertForMaskedLM(config)  # dropout 0.1 (hidden and attention), the default
    if family in ("lora", "mixture"):
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            max_position_embeddings=32, attention_dropout=0.1,
        )  # fmt: skip
        model = LlamaForCausalLM(config)
        if family == "mixture":
            return model
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], task_type="CAUSAL_LM")
        return get_peft_model(model, lora)  # the base model frozen
    if family == "bf16":
        return MLP(32, 128, 10)
    if family == "moe":
        return TaskMoE()
    if family == "heavy":
        return MLP(8, 64, 1)
    if family == "nanogpt":
        from ddphooks.models import tiny_gpt

        return tiny_gpt(vocab_size=VOCAB, hidden=64, layers=2, heads=4, block_size=SEQ, seed=seed)
    raise ValueError(family)


def optimizer_for(family: str, model: nn.Module, steps: int):
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    params = [p for p in model.parameters() if p.requires_grad]
    warmup = max(1, steps // 10)
    if family == "nanogpt":  # nanoGPT's shakespeare_char: lr 1e-3, betas (0.9, 0.99), decay to lr / 10
        opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
        warmup = min(NANOGPT_WARMUP, steps)

        def rate(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, steps - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        return opt, torch.optim.lr_scheduler.LambdaLR(opt, rate)
    if family == "cnn":
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=5e-4)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=max(1, steps // 3), gamma=0.1)
    if family in ("gpt2", "mixture", "bf16"):
        opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01 if family != "bf16" else 0.0)
        return opt, get_cosine_schedule_with_warmup(opt, warmup, steps)
    if family in ("bert", "lora"):
        opt = torch.optim.AdamW(params, lr=2e-3 if family == "bert" else 5e-3, weight_decay=0.01)
        return opt, get_linear_schedule_with_warmup(opt, warmup, steps)
    opt = torch.optim.Adam(params, lr=2e-3 if family == "moe" else 1e-3)  # moe, heavy: constant rate
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)


CLIP = {"gpt2": 1.0, "bert": 1.0, "lora": 1.0, "mixture": 1.0, "heavy": 1.0, "nanogpt": 1.0}
#: Micro-batches per step (gradient accumulation, DDP's sync only on the last, as nanoGPT's train.py does it).
MICRO_BATCHES = {"nanogpt": 2}
NANOGPT_WARMUP = 20


# -- batches ----------------------------------------------------------------------------------------
class World:
    """What every rank shares about a seed's data: templates, chains, teachers."""

    def __init__(self, family: str, seed: int) -> None:
        rng = np.random.default_rng([seed, 3])
        self.family = family
        if family == "cnn":
            self.templates = rng.normal(size=(10, 3, 12, 12)).astype(np.float32)
        elif family in ("gpt2", "bert", "lora", "nanogpt"):
            self.chain = markov_chain(seed, 3)
        elif family == "mixture":
            self.chains = [markov_chain(seed, 2), markov_chain(seed + 1, 8)]
        elif family == "bf16":
            self.teacher = teacher(seed, 32, 10)
        elif family == "moe":
            self.teachers = [teacher(seed + task, 16, 5) for task in range(3)]
        elif family == "heavy":
            self.teacher = teacher(seed, 8, 1)


def make_batch(world: World, rng: np.random.Generator) -> dict:
    family = world.family
    if family == "cnn":  # class templates, randomly shifted, plus noise; normalised per channel
        labels = rng.integers(0, 10, size=16)
        shifts = rng.integers(-2, 3, size=(16, 2))
        images = np.stack([np.roll(world.templates[y], tuple(s), axis=(1, 2)) for y, s in zip(labels, shifts)]) + rng.normal(scale=1.5, size=(16, 3, 12, 12))
        images = (images - images.mean(axis=(0, 2, 3), keepdims=True)) / images.std(axis=(0, 2, 3), keepdims=True)
        return {"x": torch.tensor(images, dtype=torch.float32), "y": torch.tensor(labels)}
    if family in ("gpt2", "lora", "nanogpt"):
        ids = torch.tensor(sample_chain(world.chain, rng, 8, SEQ))
        return {"input_ids": ids, "labels": ids.clone()}
    if family == "bert":
        ids = torch.tensor(sample_chain(world.chain, rng, 8, SEQ))
        masked = torch.tensor(rng.random(ids.shape) < 0.15)
        masked[:, 0] |= ~masked.any(dim=1)  # at least one masked token per sequence
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        return {"input_ids": torch.where(masked, torch.full_like(ids, VOCAB), ids), "labels": labels, "ids": ids, "masked": masked}
    if family == "mixture":  # a domain per rank per step: low-entropy chain, high-entropy chain, copy task
        domain = int(rng.choice(3, p=[0.5, 0.3, 0.2]))
        if domain < 2:
            ids = sample_chain(world.chains[domain], rng, 8, SEQ)
        else:
            half = rng.integers(0, VOCAB, size=(8, SEQ // 2))
            ids = np.concatenate([half, half], axis=1)
        ids = torch.tensor(ids)
        return {"input_ids": ids, "labels": ids.clone(), "domain": domain}
    if family == "bf16":
        x = rng.normal(size=(32, 32))
        return {"x": torch.tensor(x, dtype=torch.float32), "y": torch.tensor(apply_teacher(world.teacher, x).argmax(axis=1))}
    if family == "moe":
        task = int(rng.integers(0, 3))
        x = rng.normal(size=(16, 16))
        return {"x": torch.tensor(x, dtype=torch.float32), "y": torch.tensor(apply_teacher(world.teachers[task], x).argmax(axis=1)), "task": task}
    if family == "heavy":
        x = rng.normal(size=(32, 8))
        y = apply_teacher(world.teacher, x) * 3.0 + 0.3 * rng.standard_t(1.5, size=(32, 1))
        return {"x": torch.tensor(x, dtype=torch.float32), "y": torch.tensor(y, dtype=torch.float32)}
    raise ValueError(family)


def misalign(family: str, batch: dict) -> dict:
    """The labels fault: the rank's labels no longer match its inputs."""
    batch = dict(batch)
    if family in ("cnn", "bf16", "moe"):
        batch["y"] = (batch["y"] + 1) % (10 if family != "moe" else 5)
    elif family == "heavy":
        batch["y"] = batch["y"].roll(1, dims=0)  # targets of another example
    elif family == "bert":
        ids = batch["ids"].roll(-1, dims=1)  # off by one position
        batch["labels"] = torch.where(batch["masked"], ids, torch.full_like(ids, -100))
    else:  # causal LMs: labels shifted by one more position
        batch["labels"] = batch["labels"].roll(-1, dims=1)
    return batch


def forward_loss(family: str, model: nn.Module, batch: dict) -> torch.Tensor:
    if family in ("cnn", "bf16"):
        return F.cross_entropy(model(batch["x"]).float(), batch["y"])
    if family == "moe":
        return F.cross_entropy(model(batch["x"], batch["task"]).float(), batch["y"])
    if family == "heavy":
        return F.mse_loss(model(batch["x"]).float(), batch["y"])
    if family == "nanogpt":  # next-character prediction: the targets are the inputs shifted by one
        ids, labels = batch["input_ids"], batch["labels"]
        return model(ids[:, :-1], labels[:, 1:])
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


# -- one run ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    family: str
    world: int
    seed: int
    kind: str | None  # None: healthy
    steps: int
    fault_step: int | None
    fault_rank: int | None

    @property
    def name(self) -> str:
        return f"{self.family}-{self.kind or 'healthy'}-w{self.world}-s{self.seed}"


def flip_exponent_bits(seed: int, step_box: list, fault_step: int, fraction: float):
    """A param.register_hook function: from fault_step, one random exponent bit of a random
    ``fraction`` of the local gradient's entries flipped (a failing unit), seeded by (seed, step)."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        step = step_box[0]
        if step < fault_step:
            return grad
        generator = torch.Generator().manual_seed(seed * 100_003 + step)
        flat = grad.detach().float().clone().reshape(-1)
        count = max(1, round(fraction * flat.numel()))
        index = torch.randperm(flat.numel(), generator=generator)[:count]
        bits = torch.randint(23, 31, (count,), generator=generator)
        words = flat.view(torch.int32)
        words[index] = torch.bitwise_xor(words[index], torch.bitwise_left_shift(torch.ones_like(bits, dtype=torch.int32), bits.int()))
        return flat.reshape(grad.shape).to(grad.dtype)

    return hook


def scale_gradient(step_box: list, fault_step: int, factor: float):
    """A param.register_hook function: from fault_step, the local gradient times ``factor``."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad * factor if step_box[0] >= fault_step else grad

    return hook


def train(rank: int, world: int, spec: Spec, records: str | None = None) -> dict:
    """Train one run on this rank; return rank-local loss curve ends and (rank 0) the alerts."""
    family = spec.family
    faulty = spec.kind is not None and rank == spec.fault_rank
    data = World(family, spec.seed)
    model = build_model(family, spec.seed)
    ddp = DDP(model, find_unused_parameters=(family == "moe"))
    sinks = []
    if records is not None:
        header = {
            "setting": "fault" if spec.kind else family, "world_size": world, "fault_kind": spec.kind, "fault_step": spec.fault_step,
            "fault_rank": spec.fault_rank, "config": {**asdict(spec), "fault_kind": spec.kind}, "workload": family,
            "parameters": sum(p.numel() for p in model.parameters()),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        }  # fmt: skip
        sinks = [ddphooks.JsonlSink(Path(records) / f"run-{spec.name}.jsonl", header=header)]
    # Records in detail (per-parameter norms every step) only so benchmarks/detection.py can replay
    # the layer CUSUM offline; the detector online is the same either way. They keep every rank's
    # whole slot at any W (above gather_max_world too), so --redetect --compact-wire can replay
    # what the compact wire would have carried against what the whole slots carried.
    detail = {"detail_every": 1, "gather_max_world": None} if records is not None else {}
    state = ddphooks.attach(ddp, sinks=sinks, **detail)
    optimizer, schedule = optimizer_for(family, ddp, spec.steps)
    torch.manual_seed(spec.seed * 1000 + rank)  # dropout masks: a stream per rank (nanoGPT's seed_offset)
    step_box = [0]
    trainable = [(n, p) for n, p in ddp.module.named_parameters() if p.requires_grad]
    target_name, target = next(((n, p) for n, p in trainable if n == BITFLIP_TARGETS.get(family)), max(trainable, key=lambda item: item[1].numel()))
    if faulty and spec.kind == "bitflip":
        target.register_hook(flip_exponent_bits(spec.seed, step_box, spec.fault_step, BITFLIP_FRACTION))
    if faulty and spec.kind.startswith("scale"):
        for _, parameter in trainable:
            parameter.register_hook(scale_gradient(step_box, spec.fault_step, float(spec.kind.removeprefix("scale"))))
    snapshot = None
    losses, grads = [], []
    ddp.train()
    started = time.perf_counter()
    for step in range(spec.steps):
        step_box[0] = step
        active = faulty and step >= spec.fault_step
        data_step = spec.fault_step if active and spec.kind == "stuck" else step
        if faulty and spec.kind == "stale":
            if step == max(0, spec.fault_step - STALE_BACK):
                snapshot = [p.detach().clone() for p in ddp.module.parameters()]
            if step == spec.fault_step:
                with torch.no_grad():
                    for p, old in zip(ddp.module.parameters(), snapshot):
                        p.copy_(old)
        if active and spec.kind == "eval" and step == spec.fault_step:
            ddp.eval()
        bf16 = (family == "bf16") != (active and spec.kind == "precision")
        micro = MICRO_BATCHES.get(family, 1)
        for index in range(micro):
            ddp.require_backward_grad_sync = index == micro - 1  # DDP's allreduce on the last micro-batch only
            batch = make_batch(data, np.random.default_rng([spec.seed, rank, data_step] + ([index] if micro > 1 else [])))
            if active and spec.kind == "labels":
                batch = misalign(family, batch)
            with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                loss = forward_loss(family, ddp, batch)
            state.observe_loss(loss)  # unscaled: the step's loss is the mean over its micro-batches
            (loss / micro).backward()
        if family in CLIP:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP[family])
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        latest = state.latest
        grads.append({
            "losses": None if latest.losses is None else latest.losses.tolist(), "grad_norms": latest.grad_norms.tolist(),
            "cosine_previous": None if latest.cosine_previous is None else latest.cosine_previous.tolist(),
        })  # fmt: skip
    wall = time.perf_counter() - started
    state.flush()
    alerts = [brief(a) for a in state.alerts]
    state.close()
    n = min(20, len(losses))
    return {
        **asdict(spec), "name": spec.name, "alerts": alerts, "wall_s": wall, "ms_per_step": 1000 * wall / spec.steps,
        "healthy_steps": spec.steps if spec.kind is None else spec.fault_step, "target": target_name,
        "loss_first": float(np.mean(losses[:n])), "loss_last": float(np.mean(losses[-n:])),
        "parameters": sum(p.numel() for p in model.parameters()), "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "latest": grads,
    }  # fmt: skip


def brief(alert: dict) -> dict:
    """What results.jsonl keeps of an alert."""
    return {k: alert[k] for k in ("step", "rank", "kind", "since", "score", "signals", "parameters")}


def redetect(rows: list[dict], files: Path, config: DetectorConfig | None = None, compact_wire: int | None = None, peaks: bool = False) -> list[dict]:
    """The rows with their alerts detected again, offline, from each run's records (written with
    ``--records``: every step in detail, all the detector reads) by the detector of this checkout:
    the same alerts as online for the same detector, so a changed rule is measured on finished runs.
    ``compact_wire``: the records as the compact wire with that many sampled ranks would have
    written them (``ddphooks.fleet.as_compact_records``: cosines one step late, the sampled
    ranks' layer norms), what the detector would have read above ``gather_max_world``. ``peaks``:
    the healthy runs also get each CUSUM's highest level (``healthy_peaks``)."""
    out = []
    for row in rows:
        path = files / f"run-{row['name']}.jsonl"
        if not path.exists():
            raise SystemExit(f"--redetect: {path} is missing (the campaign ran without --records?)")
        records = read_run(path).records
        if compact_wire is not None:
            records = as_compact_records(records, compact_wire)
        out.append({**row, "alerts": [brief(a) for a in detect_run(records, config)]})
        if peaks and row["kind"] is None:
            out[-1]["peaks"] = healthy_peaks(records, config)
    return out


def healthy_peaks(records: list[dict], config: DetectorConfig | None) -> dict[str, float]:
    """Per CUSUM (``kind/signal``), the highest level a run's ranks reached, as a fraction of its
    alert level (1: an alert): on a healthy run, the margin left before a false alarm."""
    detector, peaks = Detector(config), {}
    for record in records:
        detector.update(Observation.from_record(record))
        for key, level in (detector.cusums.cusum.items() if detector.world else ()):
            name = "/".join(key)
            peaks[name] = max(peaks.get(name, 0.0), float(level.max() / detector.cusums.limit[key]))
    return peaks


def print_peaks(rows: list[dict]) -> dict[str, tuple[float, str]]:
    """The highest healthy level of each CUSUM over ``rows`` (``healthy_peaks``) and its run."""
    top: dict[str, tuple[float, str]] = {}
    for row in rows:
        for name, peak in row.get("peaks", {}).items():
            if peak > top.get(name, (-1.0, ""))[0]:
                top[name] = (peak, row["name"])
    print("\nhighest level of each CUSUM on the healthy runs, as a fraction of its alert level (1: an alert)")
    for name, (peak, run) in sorted(top.items()):
        print(f"{name:<26} {peak:5.2f}  {run}")
    return top


#: Healthy steps before the fault, and steps after it, over which ``norm_gap_dprime`` separates them.
DPRIME_BEFORE, DPRIME_AFTER = 100, 20
#: False-alarm rate the Lorden bound is computed at: one per this many healthy steps.
BOUND_ARL0 = 30_000


def norm_gap_dprime(records: list[dict], fault_step: int, fault_rank: int) -> float:
    """The per-step separation a gradient-scale fault leaves in the plainest signal it moves: the
    faulty rank's log gradient norm minus the median of the other ranks', ``(mean over the
    DPRIME_AFTER steps from the fault - mean over the DPRIME_BEFORE steps before it) / its
    standard deviation before it``. What the information allows: with this d' a CUSUM at one false
    alarm per BOUND_ARL0 steps needs about ``ln(BOUND_ARL0) / (d'^2 / 2)`` steps (Lorden)."""
    gaps = {}
    for record in records:
        norms = np.array([math.nan if v is None else v for v in record["grad_norms"]], dtype=float)
        others = np.delete(norms, fault_rank)
        with np.errstate(divide="ignore", invalid="ignore"):
            gaps[record["step"]] = math.log(norms[fault_rank]) - float(np.median(np.log(others)))
    before = np.array([gaps[s] for s in range(fault_step - DPRIME_BEFORE, fault_step) if s in gaps])
    after = np.array([gaps[s] for s in range(fault_step, fault_step + DPRIME_AFTER) if s in gaps])
    before, after = before[np.isfinite(before)], after[np.isfinite(after)]
    if len(before) < 10 or not len(after) or before.std() == 0:
        return math.nan
    return float((after.mean() - before.mean()) / before.std())


def print_norm_dprimes(rows: list[dict], files: Path) -> list[dict]:
    """Per fault kind, family and W: runs, named, median delay, median ``norm_gap_dprime`` and the
    bound it implies (fault runs whose records are in ``files``)."""
    cells = defaultdict(list)
    for row in rows:
        if row["kind"] is None:
            continue
        path = files / f"run-{row['name']}.jsonl"
        if not path.exists():
            raise SystemExit(f"--norm-dprime: {path} is missing (the campaign ran without --records?)")
        dprime = norm_gap_dprime(read_run(path).records, row["fault_step"], row["fault_rank"])
        named = [a["step"] - row["fault_step"] for a in row["alerts"] if a["rank"] == row["fault_rank"] and a["step"] >= row["fault_step"]]
        cells[(row["kind"], row["family"], row["world"])].append((dprime, min(named) if named else None))
    print(f"\nd' of the faulty rank's log gradient norm against the others' median ({DPRIME_AFTER} steps after the fault against {DPRIME_BEFORE} before)")
    print(f"{'fault':<10} {'family':<8} {'W':>2} {'runs':>4} {'named':>5} {'delays':<12} {'median d_prime':>14} {'bound steps':>11}")
    table = []
    for (kind, family, world), entries in sorted(cells.items()):
        dprimes = [d for d, _ in entries if math.isfinite(d)]
        median = statistics.median(dprimes) if dprimes else math.nan
        bound = math.log(BOUND_ARL0) / (median**2 / 2) if median > 0 else math.inf
        delays = ",".join("-" if delay is None else str(delay) for _, delay in entries)
        named = sum(delay is not None for _, delay in entries)
        print(f"{kind:<10} {family:<8} {world:>2} {len(entries):>4} {named:>5} {delays:<12} {median:>14.2f} {bound:>11.1f}")
        table.append({"kind": kind, "family": family, "world": world, "runs": len(entries), "named": named, "delays": [d for _, d in entries], "median_dprime": median, "bound_steps": bound})
    return table


def train_many(rank: int, world: int, specs: list[Spec], results: str | None, records: str | None, keep_latest: bool) -> list[dict]:
    """Several runs in one process group (saves the workers' start and imports); rank 0 appends one
    line per finished run to ``results``."""
    torch.set_num_threads(1)
    done = []
    for spec in specs:
        out = train(rank, world, spec, records)
        if not keep_latest:
            out.pop("latest")
        if rank == 0 and results is not None:
            with open(results, "a") as file:
                file.write(json.dumps({key: value for key, value in out.items() if key != "latest"}) + "\n")
        done.append(out)
    return done


# -- the campaign -----------------------------------------------------------------------------------
def fault_kinds(family: str) -> list[str]:
    return [kind for kind in FAULTS if kind != "eval" or family in DROPOUT_FAMILIES]


def plan(worlds, healthy_runs: int, fault_runs: int, families=FAMILIES, skip_runs: int = 0, faults=FAULTS) -> list[Spec]:
    """Healthy and fault runs, interleaved by repetition so a partial campaign stays balanced; the
    first ``skip_runs`` repetitions left out (a set held out from an earlier campaign's seeds)."""
    specs = []
    for world in worlds:
        for rep in range(skip_runs, max(healthy_runs, fault_runs)):
            for family in families:
                if rep < fault_runs:
                    for index, kind in enumerate(FAULTS):
                        if kind in fault_kinds(family) and kind in faults:
                            specs.append(Spec(family, world, FAULT_SEEDS[rep] + 10 * index, kind, FAULT_STEPS, FAULT_STEP, FAULT_RANK))
                if rep < healthy_runs:
                    specs.append(Spec(family, world, HEALTHY_SEEDS[rep], None, HEALTHY_STEPS, None, None))
    return specs


def summarize(rows: list[dict]) -> dict:
    """False alarms per family and W (per 30,000 healthy steps) and delays per fault kind and family."""
    healthy = defaultdict(lambda: [0, 0, []])  # (family, world) -> steps, alerts, details
    faults = defaultdict(list)  # (kind, family) -> one entry per run
    for row in rows:
        fault_step = row["fault_step"]
        early = [a for a in row["alerts"] if fault_step is None or a["step"] < fault_step]
        cell = healthy[(row["family"], row["world"])]
        cell[0] += row["healthy_steps"]
        cell[1] += len(early)
        cell[2] += [{"run": row["name"], **{k: a[k] for k in ("step", "rank", "kind", "signals", "score")}} for a in early]
        if row["kind"] is None:
            continue
        after = [a for a in row["alerts"] if a["step"] >= fault_step]
        right = [a for a in after if a["rank"] == row["fault_rank"]]
        first = min(right, key=lambda a: a["step"]) if right else None
        faults[(row["kind"], row["family"])].append({
            "world": row["world"], "seed": row["seed"], "delay": None if first is None else first["step"] - fault_step,
            "alert": None if first is None else f"{first['kind']}:{'+'.join(first['signals'])}",
            "wrong_rank": sum(1 for a in after if a["rank"] != row["fault_rank"]),
        })  # fmt: skip
    return {"healthy": healthy, "faults": faults}


def print_tables(rows: list[dict]) -> dict:
    found = summarize(rows)
    healthy, faults = found["healthy"], found["faults"]
    worlds = sorted({w for _, w in healthy})
    print("\nfalse alarms (alerts on healthy runs and before the fault in fault runs), per 30,000 healthy steps")
    print(f"{'family':<9}" + "".join(f" {'W=' + str(w) + ' steps':>12} {'alarms':>6}" for w in worlds) + f" {'all steps':>10} {'alarms':>6} {'per 30k':>8}")
    table = {"false_alarms": [], "delays": [], "alarm_details": []}
    for family in [*FAMILIES, "pooled"]:
        cells, total_steps, total_alarms = "", 0, 0
        for world in worlds:
            keys = [(f, world) for f in FAMILIES] if family == "pooled" else [(family, world)]
            steps = sum(healthy[k][0] for k in keys if k in healthy)
            alarms = sum(healthy[k][1] for k in keys if k in healthy)
            total_steps, total_alarms = total_steps + steps, total_alarms + alarms
            cells += f" {steps:>12} {alarms:>6}"
            table["false_alarms"].append({"family": family, "world": world, "steps": steps, "alarms": alarms})
        if total_steps:
            print(f"{family:<9}{cells} {total_steps:>10} {total_alarms:>6} {30000 * total_alarms / total_steps:>8.2f}")
    for (family, world), (_, _, details) in sorted(healthy.items()):
        for d in details:
            table["alarm_details"].append(d)
            print(f"  false alarm: {d['run']} step {d['step']} rank {d['rank']} {d['kind']} ({'+'.join(d['signals'])}) score {d['score']:.1f}")
    print("\ndelays (first alert naming the faulty rank - fault step), per fault kind and family, all W")
    print(f"{'fault':<10} {'family':<8} {'runs':>4} {'named':>5} {'median':>6} {'worst':>5} {'by W (delays)':<34} {'wrong-rank':>10}  first alert kinds")
    for kind in FAULTS:
        for family in [*FAMILIES, "all"]:
            entries = [e for (k, f), es in faults.items() if k == kind and (family == "all" or f == family) for e in es]
            if not entries:
                continue
            named = [e["delay"] for e in entries if e["delay"] is not None]
            by_world = " ".join(f"W{w}:" + ",".join("-" if e["delay"] is None else str(e["delay"]) for e in entries if e["world"] == w) for w in sorted({e["world"] for e in entries}))
            alerts = defaultdict(int)
            for e in entries:
                alerts[e["alert"] or "missed"] += 1
            median = statistics.median(named) if named else None
            worst = max(named) if named else None
            wrong = sum(e["wrong_rank"] for e in entries)
            label = family if family != "all" else "ALL"
            print(f"{kind:<10} {label:<8} {len(entries):>4} {len(named):>5} {'-' if median is None else median:>6} {'-' if worst is None else worst:>5} {by_world:<34} {wrong:>10}  {dict(alerts)}")
            table["delays"].append({"kind": kind, "family": family, "runs": len(entries), "named": len(named), "median": median, "worst": worst, "wrong_rank_alerts": wrong, "alerts": dict(alerts), "entries": entries})
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS, help="only these fault kinds (seeds do not depend on the choice)")
    parser.add_argument("--healthy-runs", type=int, default=1, help=f"healthy runs per family and W ({HEALTHY_STEPS} steps each)")
    parser.add_argument("--fault-runs", type=int, default=1, help=f"fault runs per fault kind, family and W ({FAULT_STEPS} steps, fault at {FAULT_STEP})")
    parser.add_argument("--skip-runs", type=int, default=0, help="leave out the first N repetitions of every kind (seeds of an earlier campaign: --healthy-runs 6 --fault-runs 4 --skip-runs 3 runs healthy seeds 303-305 and fault seeds 403-405)")
    parser.add_argument("--smoke", action="store_true", help="one short healthy run per family (dev seed 0), then the step times")
    parser.add_argument("--smoke-world", type=int, default=2)
    parser.add_argument("--smoke-steps", type=int, default=30)
    parser.add_argument("--out", default=OUT, help="results.jsonl (one line per finished run, resumable) goes here")
    parser.add_argument("--records", action="store_true", help="also write each run's records (JsonlSink, detail every step) under OUT/files for detection.py")
    parser.add_argument("--group", type=int, default=8, help="runs per spawn (one process group)")
    parser.add_argument("--ms-per-step", type=float, default=60.0, help="step time estimate at W = 4 for the spawn timeouts")
    parser.add_argument("--check", nargs="+", default=None, metavar="FAMILY:KIND", help="W = 2, a short healthy run and its faulty twin per pair (tests/test_workloads.py); --json gets their per-step statistics")
    parser.add_argument("--check-steps", type=int, default=6)
    parser.add_argument("--check-fault-step", type=int, default=3)
    parser.add_argument("--summarize", default=None, metavar="RESULTS", help="only print the tables of an existing results.jsonl")
    parser.add_argument("--redetect", action="store_true", help="with --summarize: detect every run again from its records (RESULTS' folder/files) with this checkout's detector")
    parser.add_argument("--norm-dprime", action="store_true", help="with --summarize: per fault run, d' of the faulty rank's log gradient norm against the others' (from RESULTS' folder/files) and the delay it allows")
    parser.add_argument("--peaks", action="store_true", help="with --redetect: also each CUSUM's highest level on the healthy runs, as a fraction of its alert level")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="with --redetect: a DetectorConfig field (repeatable), e.g. --set scale_quantile=0.5")
    parser.add_argument("--compact-wire", type=int, default=None, metavar="SAMPLED", help="with --redetect: the records as the compact wire (gather_max_world below W) with SAMPLED ranks' layer norms a step would have written them")
    parser.add_argument("--json", default=None, help="also write the tables to this file")
    args = parser.parse_args()
    for name, seeds in (("healthy_runs", HEALTHY_SEEDS), ("fault_runs", FAULT_SEEDS)):
        if getattr(args, name) > len(seeds):  # fault seeds r + 10 k: a run r >= 10 would repeat another kind's
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: at most {len(seeds)} (the seeds fixed in {name.split('_')[0].upper()}_SEEDS)")

    if args.check:
        specs = []
        for pair in args.check:
            family, kind = pair.split(":")
            specs += [Spec(family, 2, 0, None, args.check_steps, None, None), Spec(family, 2, 0, kind, args.check_steps, args.check_fault_step, 1)]
        rows = spawn(train_many, 2, args=(specs, None, None, True), timeout=600)
        out = rows[0]  # state.latest is the same on every rank: every rank's loss and gradient norm
        for row in out:
            print(f"{row['name']:<28} {row['ms_per_step']:6.1f} ms/step losses {row['loss_first']:.3f} -> {row['loss_last']:.3f}")
        if args.json:
            Path(args.json).write_text(json.dumps(out))
        return 0
    if args.summarize:
        rows = [json.loads(line) for line in Path(args.summarize).read_text().splitlines() if line.strip()]
        if args.redetect:
            rows = redetect(rows, Path(args.summarize).parent / "files", DetectorConfig.from_overrides(args.set), args.compact_wire, args.peaks)
    elif args.smoke:
        specs = [Spec(f, args.smoke_world, 0, None, args.smoke_steps, None, None) for f in args.families]
        rows = spawn(train_many, args.smoke_world, args=(specs, None, None, False), timeout=1200)[0]
        for row in rows:
            print(f"{row['family']:<8} params {row['parameters']:>7} trainable {row['trainable']:>7} {row['ms_per_step']:7.1f} ms/step loss {row['loss_first']:.3f} -> {row['loss_last']:.3f} alerts {len(row['alerts'])}")
        return 0
    else:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        results = out / "results.jsonl"
        done = {json.loads(line)["name"] for line in results.read_text().splitlines() if line.strip()} if results.exists() else set()
        specs = [s for s in plan(args.worlds, args.healthy_runs, args.fault_runs, args.families, args.skip_runs, args.faults) if s.name not in done]
        print(f"{len(specs)} runs to go ({len(done)} already in {results})", flush=True)
        records = str(out / "files") if args.records else None
        groups = [specs[i : i + args.group] for i in range(0, len(specs), args.group)]
        for number, group in enumerate(groups):
            world = group[0].world
            same = [s for s in group if s.world == world]
            rest = [s for s in group if s.world != world]
            for batch in (same, rest):
                if not batch:
                    continue
                w = batch[0].world
                estimate = sum(s.steps for s in batch) * args.ms_per_step / 1000 * (w / 4) * 3 + 120
                started = time.time()
                try:
                    spawn(train_many, w, args=(batch, str(results), records, False), timeout=estimate)
                    status = "ok"
                except Exception as error:  # a failed or hung group: report it, keep the campaign going
                    status = f"FAILED ({type(error).__name__}: {str(error)[-300:]})"
                print(f"group {number + 1}/{len(groups)} W={w} {len(batch)} runs {time.time() - started:.0f} s {status}", flush=True)
        rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    table = print_tables(rows)
    if args.summarize and args.peaks:
        table["peaks"] = print_peaks(rows)
    if args.summarize and args.norm_dprime:
        table["norm_dprimes"] = print_norm_dprimes(rows, Path(args.summarize).parent / "files")
    steps = defaultdict(int)
    for row in rows:
        steps[row["world"]] += row["healthy_steps"]
    print("\nhealthy steps per W: " + ", ".join(f"W = {w}: {n}" for w, n in sorted(steps.items())) + f"; runs: {len(rows)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"healthy_steps": dict(steps), **table}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
