"""A Hugging Face model's training step for patched-against-unpatched equality tests."""

from __future__ import annotations

import torch

MODEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SAME = dict(rtol=1e-4, atol=1e-5) if MODEL_DEVICE == "cuda" else dict(rtol=1e-5, atol=1e-6)
"""Patched and unpatched models agree this closely (float32; the GPU's kernels round apart)."""


def lm_step(model: torch.nn.Module, ids: torch.Tensor, position_ids: torch.Tensor):
    """Logits and the gradient of every parameter the loss reaches, of one language-model loss."""
    model.zero_grad(set_to_none=True)
    ids = ids.to(MODEL_DEVICE)
    out = model(input_ids=ids, position_ids=position_ids.to(MODEL_DEVICE), labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def check_same(got, expected, **tolerance) -> None:
    """Two :func:`lm_step` results equal: logits and every gradient, the same parameters'."""
    (logits, grads), (want_logits, want_grads) = got, expected
    torch.testing.assert_close(logits, want_logits, **(tolerance or SAME))
    assert grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name, **(tolerance or SAME))


def random_norm_weights(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its q_norm and k_norm weights drawn around 0.5 (a fresh model's are ones,
    which would hide a weight used in the wrong place), moved to :data:`MODEL_DEVICE`."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.normal_(0.5, 0.5)
    return model.to(MODEL_DEVICE)


def replicate(model: torch.nn.Module) -> torch.nn.Module:
    """A replica of ``model`` made as ``torch.nn.parallel.replicate`` makes ``nn.DataParallel``'s
    (each module's ``_replicate_for_data_parallel()``, children linked to their replicas, every
    parameter replaced by a copy: the broadcast to another GPU), on ``model``'s device."""
    modules = list(model.modules())
    replicas = {module: module._replicate_for_data_parallel() for module in modules}
    for module, replica in replicas.items():
        for name, child in module._modules.items():
            replica._modules[name] = None if child is None else replicas[child]
        for name, param in module._parameters.items():
            replica._parameters[name] = (
                None if param is None else param.detach().clone().requires_grad_()
            )
    return replicas[model]
