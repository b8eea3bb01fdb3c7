import macrogen as mg

model = mg.parallelize(model, pp=2, accumulate=2, microbatches=4)
model = mg.parallelize(model, pp=2, microbatches=4, schedule="zb")
model = mg.parallelize(model, pp=4, microbatches=2)
