"""Multimodal Qwen3.5 (dense and MoE `...ForConditionalGeneration`; Qwen4-Exp's and GLM-5.3-Flash's the same way)
under CP: vision on the whole batch, the language model on the rank's slice.

Each rank receives its slice of the token row (`input_ids` [B, s], `mm_token_type_ids` [B, s], the padding
mask [B, s]: what `shard_batch_for_cp` cuts) and the batch's images whole (`pixel_values`, `image_grid_thw`:
the same on every rank). A forward pre-hook on the multimodal model (vision tower + language model):

1. exchanges a header (shapes, image grid checksum, what was given) so that ranks with different inputs all
   raise together, then all-gathers the token ids, token types and mask (a few bytes per token);
2. forms the 3-D mRoPE position ids over the WHOLE row with the model's own `get_rope_index` and cuts the
   rank's slice (an image's positions depend on everything before it); a model without one (GLM-5.3-Flash: its
   language model has no positional encoding) gets none and needs no mm_token_type_ids;
3. runs the vision tower on every image of the batch (as the single device does; each rank's backward carries
   only its tokens' share of the vision gradients, so gradients summed over ranks are the single-device ones),
   picks the features of the image tokens in its slice (their order in the whole row), and places them into
   its slice's token embeddings exactly as transformers does (`masked_scatter`);
4. hands the language model `inputs_embeds` and the position ids: the text model then runs under CP as for
   text (its own pre-hook: documents, padding).

Text-only batches (no pixel_values) pass through unchanged. Videos (`pixel_values_videos`) and precomputed
encoder outputs are refused by name.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from deltacp.distributed.agree import LocalChecks, raise_together
from deltacp.distributed.collectives import all_gather_tokens
from deltacp.parallel.documents import fingerprints
from deltacp.parallel.placement import check_local_length, check_sequence_layout, rank_pieces, to_row_order

_REFUSED = ("pixel_values_videos", "video_grid_thw", "mm_encoder_outputs", "cache", "past_key_values")


def _image_features(model, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
    """All images' merged features [n_image_tokens, hidden], in image order (as transformers concatenates them)."""
    out = model.get_image_features(pixel_values, image_grid_thw)
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    if isinstance(feats, (tuple, list)):
        feats = torch.cat(list(feats), dim=0)
    return feats


def _hand_ids_to_reverse_embedding(module, input_ids: torch.Tensor, embeds: torch.Tensor) -> None:
    """A language model that re-derives the token ids from inputs_embeds (`reverse_embedding`: Qwen4-Exp, for its
    PLE layers' n-grams, where the model was given input_ids: the image tokens' own ids) gets the rank's ids for this
    one call: a one-shot instance attribute, removed when read (and replaced by the next call's); it checks that it
    is asked about these embeddings."""
    language_model = getattr(module, "language_model", None)
    if language_model is None or not hasattr(language_model, "reverse_embedding"):
        return
    if not getattr(language_model.config, "ple_layer_ids", None):  # transformers never calls it: install nothing
        return  # (an uncalled override would hold this step's embeddings until the next call)
    language_model.__dict__.pop("reverse_embedding", None)

    def reverse_embedding(inputs_embeds: torch.Tensor) -> torch.Tensor:
        language_model.__dict__.pop("reverse_embedding", None)
        if inputs_embeds is not embeds:
            raise RuntimeError("reverse_embedding under CP: asked about other inputs_embeds than the multimodal hook "
                               "formed")
        return input_ids

    language_model.reverse_embedding = reverse_embedding


def make_multimodal_hook(group, sequence_layout: str = "contiguous"):
    """The pre-hook of the module doc; `sequence_layout`: where the rank's tokens sit in the row
    (`parallel/placement.py`): the gathered row is put in row order, and the rank's tokens picked from it by their
    row positions."""
    balanced = check_sequence_layout(sequence_layout) == "balanced"

    def gather_row(x: torch.Tensor, cp: int) -> torch.Tensor:
        """[B, s] of every rank -> [B, S] in row order."""
        return to_row_order(all_gather_tokens(x.to(torch.int64), group, cp), 1, cp, balanced)

    def hook(module, args, kwargs):
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        pixel_values, grid = kwargs.get("pixel_values"), kwargs.get("image_grid_thw")
        types, mask, positions = kwargs.get("mm_token_type_ids"), kwargs.get("attention_mask"), kwargs.get("position_ids")
        local = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        B, s = local.shape[:2]
        with LocalChecks() as checks:
            refused = [k for k in _REFUSED if kwargs.get(k) is not None]
            if refused:
                raise NotImplementedError(f"{type(module).__name__} under CP does not support {refused} (videos and "
                                          f"precomputed encoder outputs are not supported; images are)")
            if pixel_values is not None:
                if input_ids is None or kwargs.get("inputs_embeds") is not None:
                    raise ValueError("images under CP need input_ids (the rank's slice, where the image tokens are) "
                                     "and no inputs_embeds")
                if grid is None:
                    raise ValueError("pixel_values under CP need image_grid_thw")
                if types is None and positions is None and hasattr(module, "get_rope_index"):
                    raise ValueError("images under CP need mm_token_type_ids (the rank's slice, as the processor "
                                     "returns it; shard_batch_for_cp cuts it) to form the mRoPE position ids")
                if types is not None and tuple(types.shape) != tuple(input_ids.shape):
                    raise ValueError(f"mm_token_type_ids must be the rank's slice {tuple(input_ids.shape)}, got "
                                     f"{tuple(types.shape)}")
                check_local_length(balanced, s, cp)
        images = {"image_grid_thw": grid, "pixel_values_shape": None if pixel_values is None else
                  torch.tensor(pixel_values.shape)}
        raise_together(group, f"{type(module).__name__} under CP", checks.error, device=local.device,
                       agree=dict(batch=B, local_length=s, images=pixel_values is not None,
                                  mm_token_type_ids=types is not None, padding_mask=mask is not None,
                                  position_ids=positions is not None, **fingerprints(images)))
        if pixel_values is None:
            return args, kwargs  # text only: the language model's own CP hook does the rest

        mine = rank_pieces(sequence_layout, rank, cp, s).row_index(input_ids.device)  # row positions of my tokens
        ids = gather_row(input_ids, cp)
        full_mask = None if mask is None else gather_row(mask, cp)
        if positions is None and hasattr(module, "get_rope_index"):  # none: a NoPE language model (GLM-5.3-Flash)
            extra = dict(image_grid_thw=grid, video_grid_thw=None, attention_mask=full_mask)
            if "mm_token_type_ids" in inspect.signature(module.get_rope_index).parameters:
                extra["mm_token_type_ids"] = gather_row(types, cp)
            full_positions, _ = module.get_rope_index(ids, **extra)
            kwargs["position_ids"] = full_positions.index_select(-1, mine.to(full_positions.device))

        embeds = module.get_input_embeddings()(input_ids)
        feats = _image_features(module, pixel_values, grid).to(embeds.device, embeds.dtype)
        is_image = ids == module.config.image_token_id  # [B, S], the whole row
        if int(is_image.sum()) != feats.shape[0]:
            raise ValueError(f"image features and image tokens do not match: {int(is_image.sum())} image tokens in "
                             f"the whole batch, {feats.shape[0]} features")
        # feature index of each image token in the row-major order of the whole batch, then this rank's tokens
        order = (is_image.flatten().cumsum(0) - 1).view(B, -1)[:, mine]
        image_here = is_image[:, mine].to(embeds.device)
        embeds = embeds.masked_scatter(image_here[..., None], feats[order[image_here].to(feats.device)])
        for key in ("input_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids"):
            kwargs.pop(key, None)
        kwargs["inputs_embeds"] = embeds
        _hand_ids_to_reverse_embedding(module, input_ids, embeds)
        return (), kwargs

    return hook
