"""Adapters that put jigsaw into other frameworks (SGLang, verl) without modifying them."""
