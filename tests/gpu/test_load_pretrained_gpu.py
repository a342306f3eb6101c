"""`load_pretrained` / `save_pretrained` on one CUDA GPU (a one-rank NCCL group, FSDP2 over it): every supported
class from a bf16 checkpoint written by transformers (several files), loaded as float32 straight onto the GPU
(`device` from the mesh): every parameter equals `from_pretrained(dtype=float32).cuda()`'s exactly, the logits of one
row agree (TF32 off, rel-L2 < 1e-5), and `save_pretrained` from the GPU reloads to the same parameters.
The 4-rank CPU test is tests/distributed/test_load_pretrained.py; peak memory at real sizes: bench/load.py --gpu.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from helpers import FAMILY_CLASSES, TEXT_VOCAB, rel_l2, tiny_config, tiny_family_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU; the CPU test is tests/distributed/test_load_pretrained.py")


@pytest.fixture(scope="module")
def nccl_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from deltacp.distributed.launch import free_port

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    yield init_device_mesh("cuda", (1,), mesh_dim_names=("cp",))
    dist.destroy_process_group()


@pytest.mark.parametrize("name", ("Qwen3_5ForCausalLM",) + FAMILY_CLASSES)
def test_every_class_loads_onto_the_gpu_as_from_pretrained(nccl_mesh, tmp_path, name):
    from deltacp import load_pretrained, save_pretrained

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    base = (transformers.Qwen3_5ForCausalLM(tiny_config()) if name == "Qwen3_5ForCausalLM"
            else tiny_family_model(name, torch.float32))
    base.to(torch.bfloat16).save_pretrained(tmp_path / "ckpt", max_shard_size="60KB")
    cls = getattr(transformers, name)
    model = load_pretrained(tmp_path / "ckpt", nccl_mesh, dtype=torch.float32)
    ref = cls.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).cuda().eval()
    ref_state = ref.state_dict()
    state = {n: t.full_tensor() for n, t in model.state_dict().items()}
    assert state.keys() == ref_state.keys()
    differ = [n for n in ref_state if not torch.equal(state[n], ref_state[n])]
    assert not differ and all(t.is_cuda for t in state.values()), differ[:3]
    ids = torch.randint(0, TEXT_VOCAB, (1, 64), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        err = rel_l2(model(input_ids=ids, use_cache=False).logits, ref(input_ids=ids, use_cache=False).logits)
    assert err < 1e-5, err
    save_pretrained(model, tmp_path / "saved", max_shard_size="60KB")
    saved = cls.from_pretrained(tmp_path / "saved").state_dict()
    assert all(torch.equal(saved[n], ref_state[n].cpu()) for n in ref_state)
