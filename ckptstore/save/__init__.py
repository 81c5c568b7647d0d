"""The save pipeline's stages: capture, plan, stage, write, commit, after-commit."""
