"""Running a scheduled step: model runner, input batch, CUDA graphs (decode and mixed), buffers."""
