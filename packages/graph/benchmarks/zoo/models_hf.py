from zoo.spec import Spec

SPECS: list[Spec] = []
