"""Tiny Hugging Face transformers models (2 layers, hidden 32) for the integration tests.

Every builder seeds torch, sets every dropout to 0 (so a data-parallel run and the
single-process reference compute the same function), and returns ``(model, batch_fn,
loss_fn)``: ``batch_fn(steps, global_batch)`` makes the global batches, ``loss_fn(model,
batch)`` the model's own loss on a batch (a slice of the global batch on a rank).
"""

from __future__ import annotations

import copy

import torch

from oracle import HP, fp32_newton_schulz, reference_optimizers

KINDS = ("llama", "qwen2", "qwen3", "gpt2", "bert", "vit")
VOCAB, SEQ = 64, 8
_COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def build(kind: str, seed: int = 0):
    import transformers as T

    torch.manual_seed(seed)
    if kind == "llama":
        model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=VOCAB, num_key_value_heads=2, **_COMMON))
    elif kind == "qwen2":  # tied embeddings, q/k/v biases
        model = T.Qwen2ForCausalLM(
            T.Qwen2Config(vocab_size=VOCAB, num_key_value_heads=2, tie_word_embeddings=True, **_COMMON)
        )
    elif kind == "qwen3":  # q/k norms
        model = T.Qwen3ForCausalLM(T.Qwen3Config(vocab_size=VOCAB, num_key_value_heads=2, head_dim=8, **_COMMON))
    elif kind == "gpt2":  # Conv1D weights (in, out), tied lm_head
        model = T.GPT2LMHeadModel(
            T.GPT2Config(
                vocab_size=VOCAB,
                n_embd=32,
                n_layer=2,
                n_head=4,
                n_positions=32,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
    elif kind == "bert":
        model = T.BertForMaskedLM(
            T.BertConfig(
                vocab_size=VOCAB,
                max_position_embeddings=32,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                **_COMMON,
            )
        )
    elif kind == "vit":
        model = T.ViTForImageClassification(
            T.ViTConfig(
                image_size=8,
                patch_size=4,
                num_channels=3,
                num_labels=5,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                **_COMMON,
            )
        )
    else:
        raise ValueError(kind)
    model.train()
    return model


def batches(kind: str, steps: int, global_batch: int = 4, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if kind == "vit":
            out.append(
                {
                    "pixel_values": torch.randn(global_batch, 3, 8, 8, generator=g),
                    "labels": torch.randint(0, 5, (global_batch,), generator=g),
                }
            )
        else:  # causal LMs shift inside; BERT predicts every token but the first
            ids = torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)
            labels = ids.clone()
            # -100 on the first token, which no causal LM predicts: Trainer counts the labels
            # that are not -100 as the loss's divisor (num_items_in_batch), before the shift
            labels[:, 0] = -100
            out.append({"input_ids": ids, "labels": labels})
    return out


def rank_slice(batch: dict, rank: int, world: int) -> dict:
    return {k: v.chunk(world)[rank] for k, v in batch.items()}


def loss_of(model, batch: dict) -> torch.Tensor:
    return model(**batch).loss


def reference_run(model, dedicated, global_batches, *, hp=HP, max_grad_norm=None, grad_norms=None):
    """One process, global batches, torch.optim.Muon (fp32 Newton-Schulz) on ``dedicated``
    FQNs and AdamW on the rest (tests/oracle.py's reference, with the model's own loss and an
    optional global gradient-norm clip, whose pre-clip norms go to ``grad_norms``). Returns
    (losses, state_dict)."""
    model = copy.deepcopy(model)
    muon, adamw = reference_optimizers(model, dedicated, hp)
    losses = []
    with fp32_newton_schulz():
        for batch in global_batches:
            loss = loss_of(model, batch)
            loss.backward()
            if max_grad_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
                if grad_norms is not None:
                    grad_norms.append(norm.item())
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
            losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def key_bias_elements(key: str, tensor: torch.Tensor) -> torch.Tensor | None:
    """Boolean mask of the elements of ``key`` that are key-projection biases, or None.

    Softmax is invariant to a shift shared by all logits of a query, so the exact gradient of a
    key bias is zero: what reaches it is floating-point noise of the order of reduction-order
    differences, and AdamW (m / sqrt(v)) turns noise of any size into full-size steps. Those
    elements are compared with :data:`KEY_BIAS_ATOL` instead of the relative bound.
    """
    mask = torch.zeros(tensor.shape, dtype=torch.bool)
    if key.endswith(("self_attn.k_proj.bias", "attention.self.key.bias", "attention.k_proj.bias")):
        mask[:] = True
    elif key.endswith("attn.c_attn.bias"):  # GPT-2: [q | k | v]
        third = tensor.shape[0] // 3
        mask[third : 2 * third] = True
    else:
        return None
    return mask


def param_errors(got: dict, want: dict) -> dict[str, float]:
    """Per tensor, max|got - want| / max|want| over the elements that are not key biases
    (keys of ``want``; all must be in ``got``); the key-bias elements' largest absolute
    difference is reported under ``key + "[key bias]"``."""
    out = {}
    for k, w in want.items():
        g = got[k].to(w.dtype)
        diff = (g - w).abs()
        mask = key_bias_elements(k, w)
        if mask is not None:
            out[k + "[key bias]"] = diff[mask].max().item()
            if bool(mask.all()):
                continue
            diff, w = diff[~mask], w[~mask]
        scale = w.abs().max().item() or 1.0
        out[k] = diff.max().item() / scale
    return out


KEY_BIAS_ATOL = 2 * 3 * 3e-3
"""Key-bias elements: within twice what AdamW can move an element in 3 steps at lr 3e-3 (a noise
gradient of the wrong sign moves it by up to about lr per step)."""


def max_param_error(got: dict, want: dict) -> float:
    """max over tensors of :func:`param_errors` (the relative ones); raises AssertionError when
    a key-bias element is off by more than :data:`KEY_BIAS_ATOL`."""
    errors = param_errors(got, want)
    for k, v in errors.items():
        if k.endswith("[key bias]"):
            assert v <= KEY_BIAS_ATOL, (k, v)
    return max(v for k, v in errors.items() if not k.endswith("[key bias]"))
