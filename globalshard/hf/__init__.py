r"""Hugging Face safetensors, both ways, through a name mapping.

* :func:`export`: a checkpoint's global tensors into safetensors files of
  bounded size plus ``model.safetensors.index.json``; fused layouts (global
  ``[Q; K; V]``, ``[gate; up]``) split into the names a Hugging Face model
  uses. Each tensor is read and written in windows of rows, so memory stays
  at one window whatever the model's size.
* :class:`SafetensorsSource`: any global box of any checkpoint key, read from
  a Hugging Face safetensors directory by file offsets (the same mapping in
  reverse), for loaders that fill a parallel layout straight from it.

The safetensors format (an 8-byte little-endian header length, a JSON header
of ``dtype``, ``shape`` and ``data_offsets`` per tensor, then the raw
little-endian bytes) is simple and fixed; it is written here by streaming
because the ``safetensors`` package needs whole tensors in memory, and read
here by offsets because its numpy API has no bfloat16. The tests check both
directions against the ``safetensors`` package itself.

A mapping file (JSON; ``globalshard/mappings/`` ships ``llama`` for the
demo's model, ``megatron_gpt`` for Megatron-Core's GPTModel saved by
globalshard's rules, ``megatron_dist`` for the same saved by Megatron's
``dist_checkpointing`` with globalshard's strategy, and
``torchtitan_llama3``, each to Hugging Face's ``LlamaForCausalLM``;
``megatron_gpt_qwen2`` and ``megatron_dist_qwen2`` to ``Qwen2ForCausalLM``;
``megatron_gpt_qwen3``, ``megatron_dist_qwen3`` and ``torchtitan_qwen3`` to
``Qwen3ForCausalLM``; ``megatron_dist_qwen3_moe`` and ``torchtitan_qwen3_moe``
to ``Qwen3MoeForCausalLM``; ``megatron_dist_qwen2_moe`` to ``Qwen2MoeForCausalLM``; ``torchtitan_deepseek_v3`` and
``megatron_dist_deepseek_v3`` to ``DeepseekV3ForCausalLM``; ``torchtitan_gpt_oss`` to
``GptOssForCausalLM``)::

    {"params": {"heads": 32, "kv_heads": 8, "rope_theta": 500000.0},
     "tensors": [
       {"key": "layers.{layer}.attn.qkv.weight", "split": {"axis": 0, "parts": [
           {"name": "model.layers.{layer}.self_attn.q_proj.weight", "size": "heads", "rotary": "heads"},
           {"name": "model.layers.{layer}.self_attn.k_proj.weight", "size": "kv_heads", "rotary": "kv_heads"},
           {"name": "model.layers.{layer}.self_attn.v_proj.weight", "size": "kv_heads"}]},
        "lora": {"A": "layers.{layer}.attn.qkv_lora_A", "B": "layers.{layer}.attn.qkv_lora_B", "scale": 1}},
       {"key": "final_norm", "name": "model.norm.weight"}],
     "skip": ["optimizer\\..*"],
     "config": {"model_type": "llama", "num_attention_heads": {"$param": "heads"},
                "hidden_size": {"$shape": "model.norm.weight", "axis": 0}}}

``{field}`` in a key matches one dot-free name part (``{layer}``: digits)
and is substituted into the names. A split's part sizes are proportions
(numbers or ``params`` names) of the axis. Every checkpoint key must match
a rule or a ``skip`` pattern: nothing is left out silently. Reading files
back (``load_hf``), a model key the files lack that a ``skip`` pattern
matches is left as it is and reported; any other is an error.

* ``lora``: the checkpoint holds a low-rank adapter of the tensor, ``W +
  scale * B @ A`` (``B`` of shape ``[rows, r]``, ``A`` of ``[r, cols]``);
  export writes the merged tensor and reports ``A`` and ``B`` as merged. An
  adapter no rule merges matches no rule: an error naming it, never a
  silent drop of what training learned. ``scale`` (default 1) may name a
  ``params`` entry with no default, asked for only once the checkpoint
  holds the adapter. ``rows`` (``{"groups": ..., "sizes": [...], "part":
  i}``): ``B`` adapts a fused tensor the checkpoint stores split, and this
  key takes the rows of part ``i`` of ``B`` split as a grouped ``split``
  would (a fused wqkv's adapter, its weight stored as wq, wk, wv). Reading files back, a model's adapters are left as
  they are (and reported as skipped).
* ``rotary`` (on a name or a split part): the tensor's rows are, per head of
  that many heads, in the interleaved rotary order (pairs ``2i, 2i + 1``, as
  Meta's Llama and torchtitan rotate them); Hugging Face rotates halves
  (``i, i + head_dim / 2``). Export permutes the rows of each head, and
  reading back permutes them back, as torchtitan's own state dict adapter
  and Hugging Face's conversion script do.
* ``groups`` (on a split of axis 0): the axis is that many equal blocks,
  each holding every part's share in order (``q1 q2 k1 v1 | q3 q4 k2 v2``,
  as Megatron-Core's ``linear_qkv`` and torchtitan's fused ``wqkv`` lay out
  grouped-query attention); a part's tensor is its rows of every block.
  Part sizes are proportions of the whole axis, as without groups.
* ``stacked`` (a list of field names, on a rule): the key's leading axes
  number those fields, as Megatron-Core's sharded state dict stacks each
  layer's tensors under one key (``"stacked": ["layer"]`` on
  ``decoder.layers.mlp.linear_fc2.weight`` of shape ``[layers, h, f]``); each
  index is one tensor of the rest of the axes, the fields substituted into
  its names. Reading Hugging Face files back (:class:`SafetensorsSource`,
  ``load_hf``), the key is those tensors one after the other on its leading
  axes (torchtitan's experts ``w1_EFD`` from ``mlp.experts.{expert}``); a
  key whose tensors are not all there (every index up to the largest
  present), or disagree in shape, is not offered, and asking for it names
  what is missing.
* ``axes`` (a permutation, on a rule with a ``name``; no ``split``,
  ``rotary`` or ``lora``): the Hugging Face tensor is the key's array (below
  its ``stacked`` axes) transposed, as ``numpy.transpose`` takes the axes:
  its axis ``i`` is the array's axis ``axes[i]`` (torchtitan's gpt-oss
  experts ``[experts, out, in]`` as Hugging Face's ``[experts, in, out]``:
  ``[0, 2, 1]``). Export writes it in windows of its own rows; reading back,
  a box of the key reads the file's rows it spans.
* ``mxfp4`` (the name of a scales tensor, on a rule with a ``name`` and
  nothing else): reading files back only, the name holds MXFP4 blocks
  (``uint8 [..., groups, bytes]``, two 4-bit E2M1 values a byte, the low
  bits first) and the scales their groups' exponents (``uint8 [...,
  groups]``, biased by 127); the key is them dequantized, ``[..., groups *
  bytes * 2]``, as bfloat16 (every such value is one), as transformers'
  ``convert_moe_packed_tensors`` dequantizes them. Only the groups a box
  spans are read. Export refuses a key whose first rule is one.
* ``config``: written as ``config.json`` beside the files. Values are JSON,
  or one of ``{"$param": name}``, ``{"$shape": hf_name, "axis": i}``
  (``"divide": param`` divides it, or ``"divide": {"$shape": ...}``), ``{"$count": hf_name_with_{layer}}``
  (how many layers have it), ``{"$indices": hf_name_with_{layer}}`` (the
  sorted layer numbers that have it), ``{"$range": n}`` (``[0, ..., n - 1]``),
  ``{"$cycle": [a, b], "count": n}`` (``n`` values, ``a, b, a, b, ...``:
  gpt-oss's ``layer_types``),
  ``{"$present": hf_name}``, ``{"$absent": hf_name}``, ``{"$equal": [a,
  b]}`` (true or false; with ``"then": a, "else": b``, the value ``a`` or
  ``b``, themselves JSON or directives; ``$param`` too chooses so, by
  whether the number is not 0, and takes ``"divide"``), ``{"$dtype":
  hf_name}`` (its exported dtype, for ``torch_dtype``). A name may hold
  ``{field}``s: ``$present`` asks whether any tensor has such a name,
  ``$shape`` and ``$dtype`` read them all, which must agree.
  ``{"$error": message}`` in a branch refuses the export with the message
  (a model the architecture cannot hold: q, k and v biases without an
  o_proj bias as a Llama). Without it no ``config.json`` is written (nor
  removed).
* ``renumber`` (a list): ``{"key": "mtp_layers.{n}.", "as": "layers.{layer}.",
  "offset": "layers"}`` reads keys under the first prefix as under the second,
  numbered after ``params.layers`` entries (torchtitan's multi-token prediction
  layers after its layers, as Hugging Face numbers them); reading back, a key
  under the second prefix from that number on is also the first's.
* ``extends``: the name of a shipped mapping, or a path from this file's
  directory. Its rules follow this file's (the first rule a key matches
  applies, on export and on reading back; ``renumber`` entries too); its
  ``params``, ``skip`` patterns and ``config`` keys are merged under this
  file's (a ``config`` key set to ``null`` is left out).

``params`` are numbers; sizes, heads and layer counts must be positive
integers. A param given that no rule or config reads is refused.
"""

from globalshard.hf.exporting import WINDOW_BYTES, export, parse_size
from globalshard.hf.naming import MAPPINGS_DIR, DamagedFileError, ExportError, HfTensor, NameMapping, shipped_mappings
from globalshard.hf.safetensors_file import SAFETENSORS_DTYPES, SafetensorsSource, read_header

__all__ = ["NameMapping", "export", "SafetensorsSource", "parse_size", "SAFETENSORS_DTYPES", "ExportError",
           "DamagedFileError", "HfTensor", "read_header", "MAPPINGS_DIR", "WINDOW_BYTES", "shipped_mappings"]
