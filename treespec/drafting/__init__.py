"""Drafters: model drafts, model-free drafts, and the draft laws children are drawn under."""
