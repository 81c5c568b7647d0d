"""The restore pipeline's stages: select the step, plan the reads, read and check, load."""
