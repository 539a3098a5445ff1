"""drama3-tiny as the package ships it: the bundled model's folder and reference voices (`shipped`).

How it is made (espeak-ng corpus, codec fit, LM training, evaluation) is research code kept out of
the package, in `recipes/drama3_tiny/` of the source tree.
"""
