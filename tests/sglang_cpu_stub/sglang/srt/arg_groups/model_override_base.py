def resolved_view(*args: object, **kwargs: object) -> object:
    raise NotImplementedError("sglang CPU stub: resolved_view needs the real sglang")
