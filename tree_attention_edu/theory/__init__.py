"""The maths around the algorithm: the energy and its derivatives (`energy`), the Bayesian
reading and the paper's appendix C corrected (`bayes`), sympy derivations (`symbolic`), and
attention as associative memory (`hopfield`). Uses `core`, nothing else of the package."""
