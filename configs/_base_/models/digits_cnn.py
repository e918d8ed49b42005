# Registered by examples.mmengine_digits: a config using this names it in custom_imports.
model = dict(type='DigitsClassifier', width=16)
