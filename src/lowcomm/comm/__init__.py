"""Schedule axis: who sends what, when, with which collective. All collectives go through
:mod:`lowcomm.comm.accounting` so every method's traffic is counted the same way."""
