"""The step in your own loop (docs/api.md): deepspeed --num_gpus 2 examples/own_loop.py [--out params.pt]
Your model, engine and data; cached_step trains k micro-batches x M pairs per rank as one N = W*k*M batch."""

import argparse

import deepspeed
import open_clip
import torch

import ds_clip

M, LR = 4, 0.5  # pairs per micro-batch and rank; the optimizer's learning rate
CONFIG = {  # your DeepSpeed config (its batch: one micro-batch); step_engine_config adds what the step needs
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
    ds_clip.prepare_for_deepspeed(model)  # 0-dim logit_scale breaks DeepSpeed's broadcast on > 1 rank
    opt = torch.optim.SGD(model.parameters(), lr=LR)  # your optimizer (SGD: the update is the gradient)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_clip.step_engine_config(CONFIG))
    rank, world, k = engine.global_rank, engine.world_size, args.accum_freq
    loss_fn = ds_clip.ContrastiveLoss(ds_clip.LossSpec(), rank=rank, world_size=world)  # CLIP, all N pairs
    for step in range(args.steps):
        ids = [rank * k + j for j in range(k)]  # this rank's global micro-batches
        seeds = [1000 * step + g for g in ids]  # dropout draws by global micro-batch, whatever W and k
        batches = [micro_batch(step, g) for g in ids]
        result = ds_clip.cached_step(engine, batches, loss_fn, micro_batch_seeds=seeds)
        ds_clip.clamp_logit_scale(engine)  # open_clip's temperature clamp, in every copy DeepSpeed keeps
        if rank == 0:
            print(f"step {step + 1}: loss {result.loss.item():.4f} over {world * k * M} pairs", flush=True)
    if args.out and rank == 0:
        torch.save(engine.module.state_dict(), args.out)  # open_clip's names and 0-dim logit_scale


if __name__ == "__main__":
    main()
