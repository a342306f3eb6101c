"""The CP trainer on a model loaded by `deltacp.load_pretrained` (built on the meta device, each rank reading its
shard, CP and FSDP2 applied while loading), at CP2 on gloo CPU ranks: the same per-step loss and grad norm, and the
same saved weights, as the trainer given the whole model (`from_pretrained`) and applying CP and FSDP2 itself;
`save_model` writes through `deltacp.save_pretrained` (each rank's shard streamed to rank 0). A model loaded with
other CP settings than the trainer's is refused, naming them."""

import os

import pytest
import torch

from deltacp.distributed.launch import run_distributed
import integ_cases


def _worker(rank, world, ckpt, out):
    from safetensors.torch import load_file
    from transformers import Qwen3_5ForCausalLM

    from deltacp import init_cp_mesh, load_pretrained

    runs = {}
    for how in ("whole", "loaded"):
        if how == "loaded":
            model = load_pretrained(ckpt, init_cp_mesh(2), dtype=torch.float32).train()
        else:
            model = Qwen3_5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        trainer = integ_cases.build("trainer-padded", os.path.join(out, how), cp_size=2, dp=1, model=model)
        trainer.train()
        runs[how] = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]
        trainer.save_model(os.path.join(out, how, "saved"))
    assert len(runs["whole"]) == integ_cases.STEPS and runs["loaded"] == runs["whole"], runs
    if rank == 0:
        saved = [load_file(os.path.join(out, how, "saved", "model.safetensors")) for how in ("whole", "loaded")]
        assert saved[0].keys() == saved[1].keys() and all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])
        for name in ("config.json", "tokenizer.json", "training_args.bin"):
            assert os.path.isfile(os.path.join(out, "loaded", "saved", name)), name

    model = load_pretrained(ckpt, init_cp_mesh(2), dtype=torch.float32, linear_attention_cp_mode="p2p")
    with pytest.raises(ValueError, match=r"a model loaded by deltacp.load_pretrained with "
                                         r"\{'linear_attention_cp_mode': 'p2p'\}: give the trainer the same"):
        integ_cases.build("trainer-padded", os.path.join(out, "refused"), cp_size=2, dp=1, model=model)


def test_the_cp_trainer_takes_a_model_loaded_by_load_pretrained(tmp_path):
    integ_cases.tiny_model().save_pretrained(tmp_path / "ckpt")
    run_distributed(_worker, 2, tmp_path / "ckpt", str(tmp_path), timeout_s=600)
