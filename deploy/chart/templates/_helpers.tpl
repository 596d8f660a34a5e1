{{/* The objects' name: the agent looks up its own DaemonSet by it (WEIR_DAEMONSET_NAME), and the
Role grants that one name alone. */}}
{{- define "weir.name" -}}weir{{- end }}

{{- define "weir.labels" -}}
app.kubernetes.io/name: {{ include "weir.name" . }}
app.kubernetes.io/component: node-agent
{{- end }}

{{- define "weir.placement" -}}
{{- if and (not .Values.chained) .Values.istioOwnedCNIConfig -}}
{{- fail "chained=false and istioOwnedCNIConfig=true: an owned config is a chain; set one" -}}
{{- end -}}
{{- if and .Values.chained .Values.cniConfFileName -}}
{{- fail "cniConfFileName names the standalone config (chained=false); chained, weir-cni joins the config the runtime loads" -}}
{{- end -}}
{{- end }}

{{- define "weir.repairAction" -}}
{{- if and .Values.repair.deletePods .Values.repair.labelPods -}}
{{- fail "repair.deletePods and repair.labelPods: set at most one" -}}
{{- end -}}
{{- if not .Values.repair.enabled -}}none
{{- else if .Values.repair.deletePods -}}delete
{{- else if .Values.repair.labelPods -}}label
{{- else -}}none
{{- end -}}
{{- end }}

{{/* The monitors' relabelings: the job named as the rules and the dashboard expect it, and the
node's name beside the instance (the node's address: the agent uses the host network). */}}
{{- define "weir.scrapeRelabelings" -}}
- targetLabel: job
  replacement: weir
- sourceLabels: [__meta_kubernetes_pod_node_name]
  targetLabel: node
{{- end }}
