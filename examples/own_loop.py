"""ds_clip's exact step in your own loop: deepspeed --num_gpus 2 examples/own_loop.py [--out params.pt]
Your model, DeepSpeed config, optimizer and data; each cached_step trains k micro-batches of M pairs per rank
as one batch of N = W*k*M pairs (README, "Use the step in your own loop"; tested in tests/test_api.py)."""

import argparse

import deepspeed
import open_clip
import torch

from ds_clip import ContrastiveLoss, LossSpec, cached_step, prepare_for_deepspeed, step_engine_config

M, LR = 4, 0.5  # pairs per micro-batch and rank; the optimizer's learning rate
CONFIG = {  # your DeepSpeed config; its batch is one micro-batch (the step runs the k of a step)
    "train_micro_batch_size_per_gpu": M,
    "zero_optimization": {"stage": 2},
    "zero_allow_untested_optimizer": True,  # a torch optimizer of your own under ZeRO
    "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 unless told otherwise
}


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    vision = dict(image_size=32, layers=1, width=32, patch_size=8, head_width=16, patch_dropout=0.25)
    text = dict(context_length=8, vocab_size=64, width=32, heads=2, layers=1)
    return open_clip.CLIP(embed_dim=16, vision_cfg=vision, text_cfg=text, output_dict=True)


def micro_batch(step: int, g: int) -> tuple[torch.Tensor, torch.Tensor]:  # your data: global micro-batch g
    gen = torch.Generator().manual_seed(1000 * step + g)
    return torch.randn(M, 3, 32, 32, generator=gen), torch.randint(1, 64, (M, 8), generator=gen)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--accum-freq", type=int, default=2)  # k: micro-batches per step and rank
    parser.add_argument("--out", help="rank 0 saves the model's state_dict here after the last step")
    parser.add_argument("--local_rank", type=int)  # appended by the deepspeed launcher
    args = parser.parse_args()
    model = build_model()
    prepare_for_deepspeed(model)  # 0-dim logit_scale breaks DeepSpeed's start-up broadcast on > 1 rank
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)  # SGD: each update is the gradient itself
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=step_engine_config(CONFIG))
    rank, world, k = engine.global_rank, engine.world_size, args.accum_freq
    loss_fn = ContrastiveLoss(LossSpec(), rank=rank, world_size=world)  # CLIP loss over all N pairs
    engine.train()
    for step in range(args.steps):
        ids = [rank * k + j for j in range(k)]  # this rank's global micro-batches
        seeds = [1000 * step + g for g in ids]  # dropout draws by global micro-batch, whatever W and k
        result = cached_step(engine, [micro_batch(step, g) for g in ids], loss_fn, micro_batch_seeds=seeds)
        if rank == 0:
            print(f"step {step + 1}: loss {result.loss.item():.4f} over {world * k * M} pairs", flush=True)
    if args.out and rank == 0:
        torch.save(engine.module.state_dict(), args.out)  # open_clip's names and 0-dim logit_scale


if __name__ == "__main__":
    main()
