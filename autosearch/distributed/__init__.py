"""torch.distributed building blocks shared by the models and the Engine: the parallel plan a
model declares (`plan.ParallelPlan`) and context-parallel attention (`context_parallel`). Nothing
here knows a model family or the Engine."""
