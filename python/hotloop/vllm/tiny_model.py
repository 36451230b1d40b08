"""A tiny random Llama-architecture model and tokenizer, built locally (no download) for vLLM tests and benchmarks.

Contract: ``build(seed=0, heads=2)`` returns a directory vLLM loads with ``LLM(model=path)``: a ``LlamaForCausalLM`` with
random weights drawn from `seed` (2 layers, hidden 128, 2 attention and 2 key/value heads of 64: vLLM's CPU
attention needs a head size it has kernels for, and tensor parallel 1 and 2 both shard it) saved as safetensors in float32, and a byte-level BPE tokenizer trained with ``tokenizers`` on
a fixed text. The same seed gives the same files. ``heads=4`` gives the same recipe four heads wide (hidden 256), for
tensor parallel 4. It is built once under ``~/.cache/hotloop`` (or
``$HOTLOOP_CACHE_DIR``) and reused; a build goes to a temporary directory renamed into place, so concurrent
builders never see half a model. Needs ``transformers`` and ``tokenizers`` (both come with vLLM).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
VERSION = 2  # bump when the recipe changes: the cache key includes it

_TEXT = """The quick brown fox jumps over the lazy dog.
A shared-memory ring carries one message from one writer to many readers.
Engines schedule requests, run a model step, and stream tokens back to their clients.
Every wait should spin briefly, then yield, then park in the kernel until there is work.
Tensor parallel workers receive the same step and each computes its shard of the layers.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000; punctuation: , . ; : ! ? ( ) [ ] { } - + = / *
"""


def cache_dir() -> str:
    return os.environ.get("HOTLOOP_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hotloop")


def config(heads: int = 2) -> dict:
    """The model's configuration with `heads` attention (and key/value) heads of 64."""
    if heads == CONFIG["num_attention_heads"]:
        return dict(CONFIG)
    return {**CONFIG, "num_attention_heads": heads, "num_key_value_heads": heads, "hidden_size": 64 * heads,
            "intermediate_size": 128 * heads}


def path_for(seed: int = 0, heads: int = 2) -> str:
    wide = "" if heads == CONFIG["num_attention_heads"] else f"-h{heads}"
    return os.path.join(cache_dir(), f"vllm-tiny-llama-v{VERSION}-seed{seed}{wide}")


def prompts(n: int, seed: int = 0) -> list[str]:
    """n distinct short prompts (deterministic)."""
    words = _TEXT.split()
    return [" ".join(words[(seed + 7 * i + j) % len(words)] for j in range(6 + i % 5)) for i in range(n)]


def build(seed: int = 0, heads: int = 2) -> str:
    """The model directory for `seed` (and `heads`), built if missing."""
    path = path_for(seed, heads)
    cfg = config(heads)
    if os.path.exists(os.path.join(path, "hotloop-tiny-model.json")):
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(cache_dir(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=cache_dir())
    try:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=CONFIG["vocab_size"], special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(_TEXT.splitlines() * 4, trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                       pad_token="<pad>", model_max_length=CONFIG["max_position_embeddings"])
        fast.save_pretrained(tmp)

        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**cfg, torch_dtype="float32"))
        with torch.no_grad():  # larger than the default 0.02 so greedy picks are decisive, not near-ties
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.2)
        # no "Writing model shards" bar: one tiny shard, and a bar starts tqdm's monitor thread in the caller's
        # process, which outlives the write (the test suite's leak check saw it in the test that built the model)
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            model.save_pretrained(tmp, safe_serialization=True)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        with open(os.path.join(tmp, "hotloop-tiny-model.json"), "w") as f:
            json.dump({"seed": seed, "version": VERSION, "config": cfg}, f)
        try:
            os.rename(tmp, path)
        except OSError:  # another process built it meanwhile
            if not os.path.exists(os.path.join(path, "hotloop-tiny-model.json")):
                raise
        return path
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
