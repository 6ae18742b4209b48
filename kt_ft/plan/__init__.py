"""Planning, touching no device: the recipe keys, the rule language (schema, loader, built-in
rules), the model families and their experts' layout, the placement plan a rule gives a model,
the memory and cost model and the planner of ``placement: auto``.
"""
