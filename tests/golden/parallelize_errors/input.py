import macrogen as mg

model = mg.parallelize(model, tp=2)
model = mg.parallelize(model, tp=2, tp_plan={"a.b": "colwse", "c": ("vocab", 2), "": "colwise"})
model = mg.parallelize(model, dp="fsdp")
model = mg.parallelize(model, tp=0, tp_plan="hf")
model = mg.parallelize(tp=2)
model = mg.parallelize(model, pp=2)
model = mg.parallelize(model, tp_plan=["layers"])
model = mg.parallelize(model, dp="fsdp", bucket_mb=4)
