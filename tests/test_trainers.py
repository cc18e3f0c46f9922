"""The trainers people use, each run as docs/guide-trainers.md gives its recipe, with a memory plan switched on by
``model = ucudnn.torch.with_plan(model, plan)``: PyTorch Lightning (automatic optimisation), the Hugging Face
`Trainer`, accelerate, and CPU autocast (bfloat16). Each trains a few steps as the same trainer does without
ucudnn: the whole-parameter norm of the difference within plain training's own rounding noise (one thread against
two: `plain_training.trains_alike`), on HF MobileNetV2, MONAI's 2-D UNet and a converted UNet, under a plan made
for a K40 at a limit that makes it both recompute and offload (the offloads copy to host memory on this CPU), the
converted one's for this CPU (recompute, and its layers' workspace budgets)."""

from __future__ import annotations

import copy
import inspect

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
monai = pytest.importorskip("monai")
lightning = pytest.importorskip("lightning")
accelerate = pytest.importorskip("accelerate")
from monai.networks.nets import UNet
from plain_training import assert_trains_alike, train
from torch.nn import functional as F

from ucudnn.errors import UcudnnError
from ucudnn.torch import PlannedModule, convert, plan_memory, with_plan

STEPS = 2
LR = 0.01


def _hf_mobilenet_v2():
    # no dropout: the noise is the rounding's, not other masks' (replayed dropout masks: test_torch_memory.py)
    config = transformers.MobileNetV2Config(
        num_labels=10, depth_multiplier=0.35, image_size=32, classifier_dropout_prob=0.0
    )
    return transformers.MobileNetV2ForImageClassification(config)


def _monai_unet():
    return UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(8, 16, 32), strides=(2, 2), num_res_units=2)


def _converted_unet():  # PyTorch's kernel behind each layer: no algorithm chosen by this machine's timings
    return convert(_monai_unet(), backend="cpu", policy="undivided", reps=1, trial_runs=0, algos=["native"])


# name -> (model, input shape, labels per sample (else per pixel), classes)
MODELS = {
    "hf-mobilenet-v2": (_hf_mobilenet_v2, (4, 3, 32, 32), True, 10),
    "monai-unet": (_monai_unet, (2, 1, 32, 32), False, 2),
    "converted-unet": (_converted_unet, (2, 1, 32, 32), False, 2),
}


def _batch(name: str, step: int):
    _, shape, per_sample, classes = MODELS[name]
    g = torch.Generator().manual_seed(step)
    x = torch.randn(*shape, generator=g)
    y = torch.randint(0, classes, (shape[0],) if per_sample else (shape[0], *shape[2:]), generator=g)
    return x, y


def _loss(out, y):
    return F.cross_entropy(out.logits if hasattr(out, "logits") else out, y)


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _samples(name: str) -> list[tuple]:
    """The STEPS batches, sample by sample (what a DataLoader with the model's batch size and no shuffling
    batches back)."""
    return [(x, y) for step in range(STEPS) for x, y in zip(*_batch(name, step), strict=True)]


@pytest.fixture(scope="module")
def plain():
    """A getter: per model name, made once, the model and its own rounding noise: how far plain training's
    parameters move on two threads from one's."""
    made = {}

    def get(name: str):
        if name not in made:
            torch.manual_seed(0)
            model = MODELS[name][0]()
            one, two = (train(copy.deepcopy(model), lambda step: _batch(name, step), threads=t) for t in (1, 2))
            made[name] = model, (one - two).norm().item()
        return made[name]

    return get


_PLANS: dict = {}


def _plan(name: str, model, keywords: bool = False):
    """A plan between the largest and the smallest peak (three tenths of the way up), made once per model (its
    copies run it): for a K40, where it recomputes some maps and offloads others; for the converted model, for
    this CPU (its layers' workspace budgets must be ones their CPU kernels run within: a K40's are not), where it
    recomputes, nothing to offload to. `keywords`: for the inputs the Hugging Face Trainer gives an HF model."""
    if (name, keywords) in _PLANS:
        return _PLANS[name, keywords]
    x, y = _batch(name, 0)
    device = None if name.startswith("converted") else "k40"

    def loss(out):
        return _loss(out, y)

    if keywords:  # as the Hugging Face Trainer calls a model that computes its loss (see `_hf_trainer`)
        x, loss = {"pixel_values": x, "labels": y, "num_items_in_batch": torch.tensor(float(len(y)))}, None
    peaks = [plan_memory(model, x, memory_limit=m, device=device, loss=loss).peak_bytes for m in (2**40, 1)]
    plan = plan_memory(model, x, memory_limit=peaks[1] + (peaks[0] - peaks[1]) * 3 // 10, device=device, loss=loss)
    actions = {t.action for t in plan.tensors}
    assert plan.fits and ({"recompute"} if device is None else {"recompute", "offload"}) <= actions, actions
    assert plan.conv_workspace or device is not None  # (the converted layers' budgets)
    _PLANS[name, keywords] = plan
    return plan


# ---- the trainers, as a user runs them (the guide's recipes); `planned` switches the plan on ----------------
def _lightning(name: str, model, planned: bool):
    import lightning as L

    if planned:
        model = with_plan(model, _plan(name, model))

    class Module(L.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            x, y = batch
            return _loss(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    loader = torch.utils.data.DataLoader(_samples(name), batch_size=MODELS[name][1][0])
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(model), loader)
    return model


def _accelerate(name: str, model, planned: bool):
    from accelerate import Accelerator

    if planned:
        model = with_plan(model, _plan(name, model))
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loader = torch.utils.data.DataLoader(_samples(name), batch_size=MODELS[name][1][0])
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for x, y in loader:
        optimizer.zero_grad()
        accelerator.backward(_loss(model(x), y))
        optimizer.step()
    return model


def _hf_trainer(name: str, model, planned: bool, tmp_path, **arguments):
    classifies = name.startswith("hf-")
    if planned:
        model = with_plan(model, _plan(name, model, keywords=classifies))
    # an HF model takes its labels and returns its loss (the Trainer finds the label names in its class's forward,
    # the planned module's class too); the others take their input as `x`, and the loss given here takes the
    # labels (named by `label_names`: the Trainer finds none in their forward's signature)
    samples = [{"pixel_values" if classifies else "x": x, "labels": y} for x, y in _samples(name)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=MODELS[name][1][0],
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        label_names=None if classifies else ["labels"],
        **arguments,
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=samples,
        optimizers=(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), None),
        compute_loss_func=None if classifies else lambda out, labels, num_items_in_batch: _loss(out, labels),
    )
    trainer.train()
    return model


def _seeded(run, *args, threads: int = 1, **kwargs):
    """`run` on `threads` threads, the random numbers (HF's dropout) drawn alike in every run."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.manual_seed(1)
    try:
        return run(*args, **kwargs)
    finally:
        torch.set_num_threads(before)


def _trains_like_without_the_plan(plain, name: str, run, *args) -> None:
    """`run` (a trainer) trains `name`'s model under its plan as without it, and the plan acted in its steps."""
    base, noise = plain(name)
    reference = _params(_seeded(run, name, copy.deepcopy(base), False, *args))
    planned = _seeded(run, name, copy.deepcopy(base), True, *args)
    offloads = any(t.action == "offload" for t in planned.plan.tensors)
    assert (planned.stats.offloaded > 0) == offloads and planned.stats.recomputed > 0, planned.stats  # (last step's)
    assert_trains_alike(_params(planned), reference, noise)


@pytest.mark.parametrize("name", list(MODELS))
def test_lightning_trains_a_planned_model_like_without_the_plan(plain, name):
    _trains_like_without_the_plan(plain, name, _lightning)


@pytest.mark.parametrize("name", list(MODELS))
def test_accelerate_trains_a_planned_model_like_without_the_plan(plain, name):
    _trains_like_without_the_plan(plain, name, _accelerate)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_hugging_face_trainer_trains_a_planned_model_like_without_the_plan(plain, name, tmp_path):
    _trains_like_without_the_plan(plain, name, _hf_trainer, tmp_path)


def test_the_planned_module_shows_the_trainer_its_model_s_signature_labels_and_loss_kwargs(tmp_path):
    """The Trainer keeps the dataset columns the forward signature names (`remove_unused_columns`), passes
    `num_items_in_batch` to a forward that takes ``**kwargs``, and finds the label names in the model's class's
    forward (`transformers.utils.find_labels(model.__class__)`): all read off the planned module, so that an
    evaluation without ``label_names=`` reports its loss."""
    model = _hf_mobilenet_v2()
    planned = with_plan(model, _plan("hf-mobilenet-v2", model))
    assert inspect.signature(planned.forward) == inspect.signature(model.forward)
    assert inspect.signature(type(planned).forward) == inspect.signature(type(model).forward)
    assert planned.module is model and isinstance(planned, PlannedModule)
    assert type(planned).__name__ == "PlannedMobileNetV2ForImageClassification"
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_eval_batch_size=4, disable_tqdm=True
    )
    samples = [{"pixel_values": x, "labels": y} for x, y in _samples("hf-mobilenet-v2")]
    trainer = transformers.Trainer(model=planned, args=args, eval_dataset=samples)
    assert trainer.model_accepts_loss_kwargs
    assert trainer.label_names == ["labels"]
    trainer._set_signature_columns_if_needed()
    assert {"pixel_values", "labels"} <= set(trainer._signature_columns)
    assert "eval_loss" in trainer.evaluate()


def test_gradient_checkpointing_on_a_planned_model_is_refused_in_one_line_and_leaves_the_model_alone(tmp_path):
    model = _hf_mobilenet_v2()
    planned = with_plan(model, _plan("hf-mobilenet-v2", model, keywords=True))
    with pytest.raises(UcudnnError) as info:
        planned.gradient_checkpointing_enable()
    assert "\n" not in str(info.value) and "before plan_memory" in str(info.value)
    with pytest.raises(UcudnnError, match="gradient checkpointing on a planned module"):  # as the Trainer asks it
        _hf_trainer("hf-mobilenet-v2", planned, False, tmp_path, gradient_checkpointing=True)
    assert not model.is_gradient_checkpointing


def _autocast_plan(name: str, model):
    """The plan of `model`'s step under CPU autocast (bfloat16), made inside the autocast block as the guide says."""
    x, y = _batch(name, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = plan_memory(model, x, memory_limit=1, loss=lambda out: _loss(out, y))
    assert "recompute" in {t.action for t in plan.tensors}
    return plan


def _autocast_steps(name: str, model, plan=None):
    """SGD steps of `model` (under `plan`), forward pass and loss under CPU autocast (bfloat16)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    if plan is not None:
        model = with_plan(model, plan)
    for step in range(STEPS):
        x, y = _batch(name, step)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model(x), y)
        loss.backward()
        optimizer.step()
    return model


def test_cpu_autocast_bfloat16_trains_a_model_planned_under_it_like_without_the_plan():
    name = "hf-mobilenet-v2"
    torch.manual_seed(0)
    base = _hf_mobilenet_v2()
    reference = _params(_seeded(_autocast_steps, name, copy.deepcopy(base)))
    noise = (reference - _params(_seeded(_autocast_steps, name, copy.deepcopy(base), threads=2))).norm().item()
    model = copy.deepcopy(base)
    planned = _seeded(_autocast_steps, name, model, _autocast_plan(name, model))
    assert planned.stats.recomputed > 0
    assert_trains_alike(_params(planned), reference, noise)
