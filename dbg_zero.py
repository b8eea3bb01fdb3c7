import torch
from tests.distributed import run_ranks
from tests.test_zero_dist import *
def f(rank, world, out_dir):
    from examples.gpt import GPT, batch
    models = expanded_models(out_dir, rank)
    config = tiny_config()
    inputs = batch(config, GLOBAL_BATCH, seed=7)
    mine = micro_batches(inputs, 1, rank, world)[0]
    out = []
    for make, groups_ in ((adamw, False), (adamw, True), (sgd, True)):
        torch.manual_seed(0); serial = GPT(config)
        so = make(nanogpt_groups(serial) if groups_ else serial.parameters()); train(serial, so, inputs, steps=5)
        torch.manual_seed(0); ours = models.Plain(config)
        o = ShardedOptimizer(make(nanogpt_groups(ours) if groups_ else ours.parameters())); train(ours, o, mine, steps=5)
        d = {n: float((a-b).abs().max()) for (n,a),(_,b) in zip(ours.named_parameters(), serial.named_parameters())}
        out.append((make.__name__, groups_, max(d.values()), [k for k,v in d.items() if v>1e-6][:5]))
    return out
if __name__ == "__main__":
    import tempfile
    print(run_ranks(f, 2, args=(tempfile.mkdtemp(),))[0])
