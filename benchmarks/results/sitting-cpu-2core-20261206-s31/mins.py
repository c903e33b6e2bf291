import json,glob,statistics as st,sys
d_=sys.argv[1]
r={}
for side in ('base','new'):
    for kind in ('levels','gpu'):
        mins=[json.load(open(f))['results']['us_per_block_min'] for f in sorted(glob.glob(f'{d_}/{side}_{kind}_r*.json'))]
        r[side,kind]=mins
        print(side,kind,'min-of-mins %.3f'%min(mins),'median-of-mins %.3f'%st.median(mins))
for side in ('base','new'):
    print(side,'ratio min-of-mins %.3f'%(min(r[side,'levels'])/min(r[side,'gpu'])),'ratio median-of-mins %.3f'%(st.median(r[side,'levels'])/st.median(r[side,'gpu'])))
