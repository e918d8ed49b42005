model = dict(type='mmengine_optim.DigitsClassifier', width=16)
