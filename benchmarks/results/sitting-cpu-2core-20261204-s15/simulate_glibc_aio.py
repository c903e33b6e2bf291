import sys
sys.argv = ["x"]
src = open("wip/glibcaio.py").read().split('if __name__ == "__main__":')[0]
exec(src)
exec(open("wip/simsteps.py").read())
print("aio writes", stats)
