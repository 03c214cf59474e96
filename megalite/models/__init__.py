from megalite.models.gpt import GPTModel  # noqa: F401
