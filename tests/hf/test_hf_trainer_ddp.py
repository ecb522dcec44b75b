"""transformers' Trainer with DDP (torchrun, 2 processes, gloo on CPU) on accelerated models of the families
whose attention relpos patches per instance (Bloom, MPT: no attention-function hook) or through
transformers' registry (Falcon with ALiBi, SwitchTransformers).

Proof: after the same steps on the same padded batches, (1) the two ranks hold identical weights (DDP
averaged the gradients that relpos's backward produced), and (2) the accelerated model's weights equal
those of transformers' own model trained the same way in the same process, to 1e-4 of how far the
training moved them (which is asserted to be large). The optimizer is SGD: Adam divides each gradient
by its own size, so a gradient that is 0 in exact arithmetic (the key bias: softmax ignores a constant
per row) and 0.0 in one implementation but 1e-9 in the other becomes a full step in one model only. T5's
Trainer-under-DDP test is in tests/hf/test_hf.py (it runs the T5 example).
"""

import pathlib
import socket
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = r"""
import copy, sys, tempfile
import torch
import torch.distributed as dist
import transformers
import relpos.hf

V = 64
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "bloom": lambda: transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=V, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0,
        initializer_range=0.2, **TOKENS)),
    "mpt": lambda: transformers.MptForCausalLM(transformers.MptConfig(
        vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=64, initializer_range=0.2, **TOKENS)),
    "falcon": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True, hidden_dropout=0.0,
        attention_dropout=0.0, initializer_range=0.2, **TOKENS)),
    "switch_transformers": lambda: transformers.SwitchTransformersForConditionalGeneration(
        transformers.SwitchTransformersConfig(
            vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
            num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_experts=2, expert_capacity=64, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, router_jitter_noise=0.0,
            dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)),
}


class Padded(torch.utils.data.Dataset):
    # example i: 12 to 40 tokens, left-padded (decoder-only generation's layout) to 40 by the collator
    def __len__(self):
        return 32

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        n = int(torch.randint(12, 41, (1,), generator=g))
        return torch.randint(3, V, (n,), generator=g)


def collate(rows):
    ids = torch.zeros(len(rows), 40, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, 40 - len(row):] = row
    mask = (ids != 0).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def train(model):
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=3, per_device_train_batch_size=4, learning_rate=0.5, optim="sgd", save_strategy="no",
            report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=0)
        transformers.Trainer(model=model, args=args, train_dataset=Padded(), data_collator=collate).train()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


lines = []
for family, build in CONFIGS.items():
    torch.manual_seed(0)
    reference = build()
    accelerated = relpos.hf.accelerate(copy.deepcopy(reference))
    start = torch.cat([p.detach().flatten() for p in reference.parameters()]).clone()
    theirs, ours = train(reference), train(accelerated)
    gathered = [torch.empty_like(ours) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, ours)
    ranks_equal = all(torch.equal(gathered[0], g) for g in gathered)
    moved = float((ours - start).abs().max() / start.abs().max())  # the steps changed the weights far beyond 1e-4
    error = float((ours - theirs).abs().max() / theirs.abs().max())
    lines.append(f"<{family} rank {dist.get_rank()} ranks_equal {ranks_equal} accelerated {relpos.hf.is_accelerated(accelerated)} "
                 f"error_ok {error <= 1e-4 * moved} moved {moved > 1e-2} error {error:.2e} moved_by {moved:.2e}>")
sys.stdout.write("\n".join(lines) + "\n")  # one write: the two ranks share the pipe
import relpos.distributed as rd
rd.exit_process(0)  # a barrier, the group destroyed, no interpreter teardown: a gloo thread can abort it
"""

FAMILIES = ("bloom", "mpt", "falcon", "switch_transformers")


def test_trainer_ddp_trains_every_patched_family_like_transformers(tmp_path):
    script = tmp_path / "ddp_families.py"
    script.write_text(SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src = str(pathlib.Path(__file__).parents[2] / "src")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port), str(script)]
    env = {**__import__("os").environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    for family in FAMILIES:
        for rank in (0, 1):
            line = f"<{family} rank {rank} ranks_equal True accelerated True error_ok True moved True"
            assert line in done.stdout, (family, rank, done.stdout[-2000:])
