"""A memory plan inside the trainers people use, through ``with_plan(model, plan)``: does each train as without
the plan, and does the eager step through the module count the peak the plan predicts?

Models (`models.py`, the `models` extra): HF MobileNetV2 and MONAI's 2-D UNet at ``--size`` px, batch 4 and 2,
each planned for ``--plan-device`` (``k40``: its plans both recompute and offload; ``none``: this machine's) at
three tenths of the way from the smallest peak to the largest. Trainers (the `trainers` extra): PyTorch Lightning
(automatic optimisation), the Hugging Face `Trainer` (MobileNetV2, which computes its own loss), accelerate and a
plain loop under CPU/CUDA autocast (bfloat16; its plan made inside autocast, for this machine). Each trains
``--steps`` SGD steps, plain and planned, from the same weights; the planned parameters' distance to plain's
is given against plain training's own rounding noise (the same trainer on two threads against one): ``ratio``
at most 2 is equal training (as `tests/plain_training.trains_alike`).

Counted / predicted: one eager training step through the module (forward pass, then the loss's backward pass
after the call returned, as a trainer runs them), after a warm-up step, counted by `StepTracker` (the model's
device: every category but the host copies), over the plan's ``peak_bytes``. On a CPU the offload copies finish
at once, so an offloaded map leaves the device earlier than a GPU's copy stream lets it.

    pip install -e '.[models,trainers]'
    OMP_NUM_THREADS=1 python benchmarks/memory/bench_trainers.py [--device cpu|cuda] [--steps 2] [--size 32]
        [--plan-device k40|none] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, models.py
import torch
from common import table, write_json
from models import build, loss

from ucudnn.torch import StepTracker, plan_memory, with_plan

MODELS = {"hf-mobilenet-v2": 4, "monai-unet": 2}  # name -> batch


def params(model) -> torch.Tensor:
    return torch.cat([p.detach().float().cpu().flatten() for p in model.parameters()])


def batches(x, y, steps: int) -> list[tuple]:
    return [(x[i], y[i]) for _ in range(steps) for i in range(len(x))]


def lightning_run(model, x, y, steps: int, device: str):
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return loss(self.model(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    trainer = L.Trainer(
        accelerator=device,
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(model), torch.utils.data.DataLoader(batches(x, y, steps), batch_size=len(x)))
    return model


def hf_run(model, x, y, steps: int, device: str):
    import transformers

    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out,
            max_steps=steps,
            per_device_train_batch_size=len(x),
            learning_rate=0.01,
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            use_cpu=device == "cpu",
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
        )
        data = [{"pixel_values": a, "labels": b} for a, b in batches(x, y, steps)]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, None)).train()
    return model


def accelerate_run(model, x, y, steps: int, device: str):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=device == "cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = torch.utils.data.DataLoader(batches(x, y, steps), batch_size=len(x))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for a, b in loader:
        optimizer.zero_grad()
        accelerator.backward(loss(model(a), b))
        optimizer.step()
    return model


def autocast_run(model, x, y, steps: int, device: str):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16):
            out = loss(model(x), y)
        out.backward()
        optimizer.step()
    return model


TRAINERS = {"lightning": lightning_run, "hf-trainer": hf_run, "accelerate": accelerate_run, "autocast": autocast_run}


def make_plan(model, x, y, device: str | None, trainer: str, autocast: str | None = None):
    """The plan a third of the way up, for the inputs the trainer passes (the HF Trainer: keywords)."""
    example, planned_loss = x, (lambda out: loss(out, y))
    if trainer == "hf-trainer":
        example, planned_loss = (
            {"pixel_values": x, "labels": y, "num_items_in_batch": torch.tensor(float(len(y)))},
            None,
        )
    with torch.autocast(autocast or "cpu", dtype=torch.bfloat16, enabled=autocast is not None):
        peaks = [
            plan_memory(model, example, memory_limit=m, device=device, loss=planned_loss).peak_bytes for m in (2**40, 1)
        ]
        limit = peaks[1] + (peaks[0] - peaks[1]) * 3 // 10
        return plan_memory(model, example, memory_limit=limit, device=device, loss=planned_loss)


def run(trainer: str, base, x, y, steps: int, device: str, plan=None, threads: int = 1):
    torch.set_num_threads(threads)
    model = copy.deepcopy(base).to(device)
    if plan is not None:
        model = with_plan(model, plan)
    torch.manual_seed(1)
    return TRAINERS[trainer](model, x.to(device), y.to(device), steps, device)


def counted(base, plan, x, y, device: str) -> int:
    """StepTracker's peak of one eager step through the module, after a warm-up step."""
    model = copy.deepcopy(base).to(device)
    planned = with_plan(model, plan)
    x, y = x.to(device), y.to(device)
    loss(planned(x), y).backward()
    model.zero_grad(set_to_none=True)
    with StepTracker(model) as tracker:
        tracker.track(x, "tensor")
        tracker.track(y, "tensor")
        out = planned(x)
        value = loss(out, y)
        del out
        value.backward()
        del value
    return tracker.report().peak_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--plan-device", default="k40", help="a device profile, or none: the model's device")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    plan_device = None if args.plan_device == "none" else args.plan_device
    rows, records = [], []
    for name, batch in MODELS.items():
        base, x, y = build(name, batch, args.size)
        for m in base.modules():  # no dropout: the noise is the rounding's, not two runs' masks
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        for trainer in TRAINERS:
            if trainer == "hf-trainer" and not name.startswith("hf-"):
                continue  # (a model that computes its own loss: the recipe's)
            autocast = args.device if trainer == "autocast" else None
            plan = make_plan(
                copy.deepcopy(base).to(args.device),
                x.to(args.device),
                y.to(args.device),
                None if autocast else plan_device,
                trainer,
                autocast,
            )
            reference = params(run(trainer, base, x, y, args.steps, args.device))
            noise = (reference - params(run(trainer, base, x, y, args.steps, args.device, threads=2))).norm().item()
            planned = run(trainer, base, x, y, args.steps, args.device, plan)
            distance = (params(planned) - reference).norm().item()
            ratio = distance / max(noise, 1e-6 * reference.norm().item())
            peak = counted(base, plan, x, y, args.device) if trainer == "lightning" else None  # (accelerate: same plan)
            actions = sorted({t.action for t in plan.tensors} - {"keep", "release"})
            record = {
                "model": name,
                "trainer": trainer,
                "actions": actions,
                "distance": distance,
                "noise": noise,
                "ratio": ratio,
                "offloaded": planned.stats.offloaded,
                "recomputed": planned.stats.recomputed,
                "predicted": plan.peak_bytes,
                "counted": peak,
            }
            records.append(record)
            rows.append(
                [
                    name,
                    trainer,
                    "+".join(actions),
                    f"{distance:.2e}",
                    f"{noise:.2e}",
                    f"{ratio:.2f}",
                    "-" if peak is None else f"{peak / plan.peak_bytes:.3f}",
                ]
            )
    print(table(["model", "trainer", "plan acts", "|planned-plain|", "noise", "ratio", "counted/predicted"], rows))
    if args.json:
        write_json(args.json, {"device": args.device, "steps": args.steps, "runs": records})
    return 0 if all(r["ratio"] <= 2 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
